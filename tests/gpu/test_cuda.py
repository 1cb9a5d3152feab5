"""What only a CUDA GPU can show (marked `cuda`: skipped where torch sees none, so CI, which has no GPU, skips
them; `bash tests/gpu_check.sh` runs them on a GPU machine): chat_rl through torchrun on NCCL equals the
single process, a bf16 step stays near the fp32 one, a real out-of-memory during rollouts is backed off without
losing the step, chat_sft and chat_eval run on CUDA, and a checkpoint crosses between CUDA and the CPU."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import HAS_CUDA, PYTHONPATH, REPO, TINY_RL_FLAGS, make_sft_checkpoint, random_model, tiny_config

from nanochat.checkpoints.loading import load_model
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.policy_gradient import accumulate_policy_gradient
from nanochat.runtime.device import to_device

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

# --compile=off, pinned (auto also compiles nothing on CUDA, for now): these runs test NCCL, out-of-memory and
# devices, not compiling; compiling in each subprocess (then auto's choice on CUDA) kept the first H100 run of this
# file past its 200 s before its first test ended. Compiling on CUDA is tested and measured by `gpu_check.sh compiled`.
NO_COMPILE = ["--compile=off"]
CUDA_RL_FLAGS = [f for f in TINY_RL_FLAGS if not f.startswith("--device-type")] + ["--device-type=cuda"] + NO_COMPILE


def run(cmd, base_dir, **env):
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "PYTHONPATH": PYTHONPATH, **env})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_torchrun_on_nccl_equals_the_single_process(sft, base_dir, tmp_path):
    """One rank under torchrun (NCCL process group, distributed optimizers) writes the weights of a plain process."""
    flags = CUDA_RL_FLAGS + ["--num-steps=2", "--save-every=-1"]
    run([sys.executable, "-m", "scripts.chat_rl", *flags], base_dir)
    rl_dir = base_dir / "chatrl_checkpoints" / "d2"
    single = torch.load(rl_dir / "model_000001.pt", weights_only=True)
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "scripts.chat_rl",
               "--", *flags, "--overwrite"], base_dir)
    assert "Step 1/2" in out
    nccl = torch.load(rl_dir / "model_000001.pt", weights_only=True)
    for k in single:
        torch.testing.assert_close(nccl[k], single[k], atol=1e-5, rtol=0, msg=k)


def test_a_bf16_step_stays_near_the_fp32_step(tiny_tokenizer):
    """The policy-gradient pass under bf16 autocast against fp32 on the same rollouts: objective within 1% of its
    terms' scale, gradient direction within cosine 0.99 (bf16 keeps 8 bits of mantissa; a bug, e.g. a wrong cast,
    is far off).

    The scale is the objective with every advantage made positive (sum |adv * logp| / tokens): the objective
    itself is a difference of such terms (advantages sum to 0 per question) and may cancel to near 0, so a bound
    relative to it fails on rounding alone (on the first GPU run: 7% of the objective, 0.05% of the scale; on a
    CPU under bf16 autocast 0.03-0.04% of the scale, over three seeds)."""
    model = random_model(tiny_config(sequence_len=128, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")).cuda()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (20,), generator=gen).tolist()
    completions = [(torch.randint(0, 300, (30,), generator=gen).tolist(), [1] * 30) for _ in range(4)]
    batch = make_question_batch(prompt, completions, [1.0, 0.0, 1.0, 0.0], pad_token=0)

    def policy_gradient(batch, dtype):
        model.zero_grad(set_to_none=True)
        autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32)
        stats = accumulate_policy_gradient(model, [batch], 4, 1, torch.device("cuda"), autocast)
        return stats.objective, torch.cat([p.grad.flatten() for p in model.parameters()])

    o32, g32 = policy_gradient(batch, torch.float32)
    o16, g16 = policy_gradient(batch, torch.bfloat16)
    scale, _ = policy_gradient(dataclasses.replace(batch, advantages=batch.advantages.abs()), torch.float32)
    assert abs(o16 - o32) <= 0.01 * abs(scale)
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) >= 0.99


def test_to_device_queues_the_copy_instead_of_waiting_for_the_gpu():
    """nanochat.runtime.device.to_device (the training pass's host-to-GPU copies): with a kernel still running, the copy
    returns at once and the stream is still busy; a plain .to("cuda") waits for the kernel first (the stall the
    training pass had once per index tensor). The copied values are the host's."""
    device = torch.device("cuda")
    host = torch.arange(1000)
    to_device(host, device)  # the pinned host allocator's first block (a fresh cudaHostAlloc may wait), as in training
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time at ~2 GHz
    queued = to_device(host, device)
    assert not torch.cuda.current_stream().query()  # the host did not wait for the sleeping kernel
    torch.cuda._sleep(200_000_000)
    plain = host.to(device)
    assert torch.cuda.current_stream().query()  # a pageable copy synchronizes the stream
    assert torch.equal(queued.cpu(), host) and torch.equal(plain.cpu(), host)


# The out-of-memory test's model: wide enough that its KV cache, not the run's fixed allocations (CUDA context,
# cuBLAS workspaces, streams), decides what fits. 4 layers x 4 KV heads x 128 channels x keys and values: 8 KiB a
# bf16 token (16 in fp32), so 256 rows of ~1,090 positions take ~2.3 GB (4.5 in fp32), 64 rows ~0.6 GB (1.1).
OOM_MODEL = dict(sequence_len=1152, n_layer=4, n_head=4, n_kv_head=4, n_embd=512)
OOM_HEADROOM = 2 ** 30  # what the ballast leaves the rollout: less than every row needs, more than a few rows do


def test_a_real_out_of_memory_in_rollouts_is_backed_off(base_dir, tiny_tokenizer):
    """A ballast leaves the rollout 1 GiB of the GPU (taken when the rollout starts, so the run's own fixed
    allocations are made by then, and given back when it returns, so training has the GPU), and a memory budget
    lets the engine try every row at once: 256 rows of 1,024 new tokens do not fit, chat_rl halves the rows, says
    so, and finishes the step with the same rewards as a run that never ran out (rows do not change what is
    sampled). (The first form of this test took the ballast before the run started, with 160 MB left: the run's
    fixed allocations since left too little for one row, and the CUDA runtime could not make a stream on an H200.)"""
    make_sft_checkpoint(base_dir, tiny_tokenizer.get_vocab_size(), **OOM_MODEL)
    flags = CUDA_RL_FLAGS + ["--num-steps=1", "--num-samples=64", "--device-batch-size=64", "--examples-per-step=4",
                             "--max-new-tokens=1024", "--memory-budget-gb=1000"]
    reference = run([sys.executable, "-m", "scripts.chat_rl", *flags, "--max-rows=64"], base_dir)
    code = f"""
import torch
from nanochat.cli import run_main
from nanochat.engine.memory import RolloutMemory
from scripts import chat_rl

within_memory = RolloutMemory.within_memory

def with_ballast(memory, rollout, *args):  # a step's rollouts, which back off where they run out of memory
    def attempt(*given):  # each attempt finds OOM_HEADROOM free, whatever came before
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        ballast = torch.empty(max(0, free - {OOM_HEADROOM}), dtype=torch.uint8, device="cuda")
        try:
            return rollout(*given)
        finally:
            del ballast
    return within_memory(memory, attempt, *args)

RolloutMemory.within_memory = with_ballast
run_main(chat_rl.main, {flags + ['--overwrite']!r})
"""
    out = run([sys.executable, "-c", code], base_dir)
    assert "out of memory during rollouts: retrying with --max-rows=128" in out
    reward = lambda text: [line.split("Average reward: ")[1].split(" ")[0] for line in text.splitlines() if "Average reward" in line]
    assert reward(out) == reward(reference) and reward(out)


def test_chat_sft_and_chat_eval_run_on_cuda_and_the_checkpoint_loads_on_the_cpu(base_dir):
    """A model trained on CUDA is saved, loads on the CPU with the same weights, evaluates on CUDA, and a model
    saved from the CPU loads back on CUDA."""
    run([sys.executable, "-m", "scripts.chat_sft", "--depth=2", "--tasks=arithmetic", "--num-steps=3", "--eval-every=-1",
         "--device-type=cuda", "--examples-per-step=8", "--device-batch-size=8", "--sequence-len=256", *NO_COMPILE], base_dir)
    on_cpu, _, meta = load_model("sft", torch.device("cpu"), phase="eval")
    on_cuda, _, _ = load_model("sft", torch.device("cuda"), phase="eval")
    assert meta["step"] == 3
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu.state_dict().values(), on_cuda.state_dict().values()))
    run([sys.executable, "-m", "scripts.chat_eval", "--source=sft", "--task=arithmetic", "--num-examples=4",
         "--num-samples=2", "--max-new-tokens=32", "--device-type=cuda", *NO_COMPILE], base_dir)
    result = json.loads((base_dir / "report" / "chat_eval_sft.json").read_text())
    assert result["num_questions"] == 4 and 0 <= result["greedy_pass@1"] <= 1
