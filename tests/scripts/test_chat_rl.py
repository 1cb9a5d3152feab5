"""chat_rl end to end on a tiny model: flags, checkpoints, and 2-rank equivalence with 1 rank."""

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from helpers import FP32_GAP_BOUND, PYTHONPATH, REPO, TINY_RL_FLAGS

from nanochat.runtime import device as nc_device
from nanochat.checkpoints.loading import load_model
from nanochat.cli import run_main
from nanochat.rl import plan as rl_plan, progress as rl_progress, run as rl_run
from nanochat.rl.rollout import step_question_indices
from scripts import chat_rl


def test_two_steps_write_a_loadable_rl_checkpoint_with_new_weights(sft, base_dir, capsys):
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=1"])
    out = capsys.readouterr().out
    assert "Step 0/2 | Average reward:" in out and "Step 1/2 | Average reward:" in out
    rl_dir = base_dir / "chatrl_checkpoints" / "d2"
    assert sorted(p.name for p in rl_dir.glob("model_*.pt")) == ["model_000001.pt"]  # step 0 is never saved
    assert (rl_dir / "optim_000001_rank0.pt").exists()
    model, _, meta = load_model("rl", "cpu", "eval")
    assert meta["model_config"] == asdict(sft.config)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, sft.state_dict()[k])]
    assert "lm_head.weight" in changed and any(".attn.c_q." in k for k in changed)


def test_eval_prints_pass_at_k(sft, base_dir, capsys):
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--eval-every=1", "--eval-examples=3"])
    out = capsys.readouterr().out
    assert "Step 0 | Pass@1: " in out and "Pass@2: " in out  # device_batch_size=2 samples -> pass@1, pass@2
    assert "Step 1 | Pass@1: " in out                       # and after the last update


@pytest.mark.parametrize("flags, message", [
    (["--num-samples=4", "--device-batch-size=8"], "--num-samples (4) must be a multiple of --device-batch-size (8)"),
    (["--num-samples=12", "--device-batch-size=8"], "e.g. --device-batch-size=6"),
    (["--temperature=-1"], "--temperature must be >= 0"),
    (["--dtype=fp8"], "--dtype must be auto, float32, bfloat16 or float16, got 'fp8'"),  # float16: tests/optim/test_fp16.py
    (["--rollout-dtype=half"], "--rollout-dtype must be auto, float32, bfloat16 or float16, got 'half'"),
    (["--eval-every=0"], "--eval-every must be >= 1, or -1"),
    (["--init-lr-frac=0"], "--init-lr-frac must be in (0, 1]"),
    (["--task=nosuchtask"], "unknown task 'nosuchtask'"),
    (["--task=gsm8k", "--source=mid"], "mid_checkpoints"),
    (["--task=nosuchmodule:Cls"], "cannot import task module 'nosuchmodule'"),
    (["--source=pretrain"], "--source must be base, mid, sft, rl, got 'pretrain'"),
    (["--source=base"], "base_checkpoints"),  # accepted; there is just no base checkpoint here
    (["--source=rl", "--model-tag=d2", "--output-tag=d2"], "--output-tag=d2 is the RL run --source=rl reads"),
    (["--resume", "--output-tag=x"], "--resume continues a run in its own directory"),
    (["--output-tag=a/b"], "--output-tag must be a directory name"),
    (["--rollout-correction=tis"],
     "--rollout-correction must be none, token-tis, sequence-mask, geo-mask, token-mask, got 'tis'"),
    (["--rollout-correction-cap=1"], "--rollout-correction-cap must be > 1, got 1.0"),
    (["--decode=fast"], "--decode"),
])
def test_invalid_flags_exit_with_one_line(sft, flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_examples_per_step_must_divide_by_world_size(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS)  # fails validation before any process group is created
    assert e.value.code == 2
    assert "--examples-per-step (4) must be divisible by the number of ranks (3)" in capsys.readouterr().err


def test_missing_checkpoint_is_a_one_line_error(base_dir, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "chatsft_checkpoints" in err and err.count("\n") == 1


def test_unknown_task_is_reported_before_any_checkpoint_is_opened(tmp_path, monkeypatch, capsys):
    """Regression: an unknown --task was only reported after the model had loaded (minutes on a big model).
    With an empty base dir, a late check would fail on the missing checkpoint instead."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(empty))
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, [f for f in TINY_RL_FLAGS if not f.startswith("--task")] + ["--task=nosuchtask"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: unknown task 'nosuchtask'") and "checkpoints" not in err
    assert list(empty.iterdir()) == []


def test_nanochat_dtype_environment_variable(sft, base_dir, monkeypatch):
    """NANOCHAT_DTYPE (how current nanochat sets precision) is honoured when --dtype is not given, and an
    explicit --dtype wins over it. The CPU is made to look bf16-capable so that bfloat16 would really run."""
    monkeypatch.setenv("NANOCHAT_CPU_BF16", "avx512-bf16")
    no_dtype = [f for f in TINY_RL_FLAGS if not f.startswith("--dtype")] + ["--num-steps=1", "--rollout-dtype=float32"]
    recorded = lambda: json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000000.json").read_text())["user_config"]["dtype"]

    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")
    chat_rl.main(no_dtype)
    assert recorded() == "float32"
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    chat_rl.main(no_dtype + ["--overwrite"])
    assert recorded() == "bfloat16"  # forced: not measured
    chat_rl.main(no_dtype + ["--dtype=float32", "--overwrite"])
    assert recorded() == "float32"


def files_with_digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(directory).iterdir())}


def test_source_rl_starts_a_new_run_next_to_the_one_it_reads(sft, base_dir, tiny_tokenizer, capsys):
    """--source=rl: a new run from an RL checkpoint, written to chatrl_checkpoints/<tag>_cont (or --output-tag);
    the run it reads is left byte-identical, and writing into it is refused (--resume continues a run)."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=1"])
    rl_root = base_dir / "chatrl_checkpoints"
    before = files_with_digests(rl_root / "d2")
    first = torch.load(rl_root / "d2" / "model_000001.pt", weights_only=True)
    capsys.readouterr()

    chat_rl.main(TINY_RL_FLAGS + ["--source=rl", "--num-steps=2", "--save-every=1"])
    out = capsys.readouterr().out
    assert f"Loading model from {rl_root / 'd2'} with step 1" in out
    assert "Step 0/2 | Average reward:" in out and "Step 1/2 | Average reward:" in out
    assert files_with_digests(rl_root / "d2") == before
    cont = rl_root / "d2_cont"
    assert sorted(p.name for p in cont.iterdir()) == ["meta_000001.json", "model_000001.pt", "optim_000001_rank0.pt"]
    meta = json.loads((cont / "meta_000001.json").read_text())
    assert meta["user_config"]["source"] == "rl" and meta["user_config"]["output_tag"] == "d2_cont"
    second = torch.load(cont / "model_000001.pt", weights_only=True)
    assert any(not torch.equal(first[k], second[k]) for k in first)  # it trained

    # --output-tag names the new run; naming the source run is refused before anything is written
    chat_rl.main(TINY_RL_FLAGS + ["--source=rl", "--model-tag=d2", "--output-tag=d2_b", "--num-steps=1"])
    assert (rl_root / "d2_b" / "model_000000.pt").exists()
    # without --model-tag the source is the newest depth-2 run (d2_b, a tie in depth): writing into it is refused
    runs = {tag: files_with_digests(rl_root / tag) for tag in ("d2", "d2_cont", "d2_b")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS + ["--source=rl", "--output-tag=d2_b", "--num-steps=1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--output-tag=d2_b is the RL run --source=rl reads" in err and "--resume=d2_b" in err
    assert {tag: files_with_digests(rl_root / tag) for tag in runs} == runs
    assert runs["d2"] == before


def test_logged_lengths_count_the_prompt_like_nanochat(sft, base_dir, tiny_tokenizer, capsys):
    """nanochat's 'Average sequence length' (wandb: sequence_length) is prompt + completion, because its engine
    returns each sample with the prompt; the completion alone is logged as completion_length. The project
    used to log the completion length under nanochat's name."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("Step 0/1 |"))
    seq = float(re.search(r"Average sequence length: ([\d.]+)", line).group(1))
    completion = float(re.search(r"Average completion length: ([\d.]+)", line).group(1))
    from rl_toy_task import ParityTask
    task = ParityTask("train")
    prompts = [len(tiny_tokenizer.render_for_completion(task[i])) for i in step_question_indices(0, 4, 0, 1, 16)]
    assert seq - completion == pytest.approx(sum(prompts) / len(prompts), abs=0.011)
    record = json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000000.json").read_text())["history"][0]
    assert record["sequence_length"] == pytest.approx(record["completion_length"] + sum(prompts) / len(prompts))
    assert record["completion_length"] == pytest.approx(completion, abs=0.006)


def test_eval_steps_for_the_eta():
    assert [s for s in range(11) if rl_progress.is_eval_step(s, 10, 4)] == [0, 4, 8, 10]
    assert [s for s in range(11) if rl_progress.is_eval_step(s, 10, -1)] == []
    assert [s for s in range(9) if rl_progress.is_eval_step(s, 8, 4)] == [0, 4, 8]


@pytest.mark.slow
def test_two_ranks_end_with_the_same_weights_as_one(sft, base_dir, tmp_path):
    """Distributed equivalence. Why equality must hold: each question's samples are seeded by
    (step, question index) and each row has its own random stream, so both layouts sample the same
    completions for the same questions; the objective is normalized per question pass and divided by the
    questions per rank, and the optimizers average gradients over ranks, so the 2-rank gradient
    (mean over ranks of per-rank sums / 2) equals the 1-rank one (sum / 4). Differences are only float
    summation order, far below 1e-5."""
    flags = TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1"]
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": PYTHONPATH}
    run = lambda cmd: subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    single = run([sys.executable, "-m", "scripts.chat_rl", *flags])
    assert single.returncode == 0, single.stderr[-3000:]
    rl_dir = base_dir / "chatrl_checkpoints" / "d2"
    one = torch.load(rl_dir / "model_000001.pt", weights_only=True)
    (rl_dir / "model_000001.pt").rename(tmp_path / "one.pt")
    double = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  "-m", "scripts.chat_rl", "--", *flags, "--overwrite"])
    assert double.returncode == 0, double.stderr[-3000:]
    two = torch.load(rl_dir / "model_000001.pt", weights_only=True)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5, rtol=0), key
    assert any(not torch.equal(one[k], sft.state_dict()[k]) for k in one)
    # rewards logged by both runs agree step by step
    rewards = lambda out: [line.split("Average reward: ")[1].split(" ")[0] for line in out.splitlines() if "Average reward" in line]
    assert rewards(single.stdout) == rewards(double.stdout)


@pytest.fixture
def measurements(monkeypatch):
    """chat_rl's two timings replaced by scripted answers: `answers[phase]` is the dtype the timing of that phase
    returns ("training" or "rollouts"); each call is recorded in `calls` as (phase, candidates)."""
    state = {"answers": {"training": torch.float32, "rollouts": torch.float32}, "calls": []}

    def fake(phase):
        def measure(model, *args):
            state["calls"].append((phase, args[-1]))
            return state["answers"][phase]
        return measure
    monkeypatch.setattr(rl_plan, "fastest_training_dtype", fake("training"))
    monkeypatch.setattr(rl_plan, "fastest_rollout_dtype", fake("rollouts"))
    return state


def recorded_dtypes(base_dir, step):
    config = json.loads((base_dir / "chatrl_checkpoints" / "d2" / f"meta_{step:06d}.json").read_text())["user_config"]
    return config["dtype"], config["rollout_dtype"]


AUTO_FLAGS = [f for f in TINY_RL_FLAGS if not f.startswith("--dtype")]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "avx512-bf16", "amx"])
@pytest.mark.parametrize("training, rollouts", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_auto_dtypes_follow_the_cpu_kind_and_the_measurements(kind, training, rollouts, sft, base_dir, monkeypatch,
                                                                measurements, capsys):
    """--dtype=auto (the default): a CPU without native bf16 computes both phases in float32 without timing
    anything; one with AVX512-BF16 or AMX times training and decoding separately, fp32 preferred (the
    candidates' order), and runs and records what each timing chose."""
    monkeypatch.setenv("NANOCHAT_CPU_BF16", kind)
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    measurements["answers"].update(training=training, rollouts=rollouts)
    chat_rl.main(AUTO_FLAGS + ["--num-steps=1"])
    out = capsys.readouterr().out
    name = lambda dtype: str(dtype).removeprefix("torch.")
    if kind == "none":
        assert measurements["calls"] == []
        assert recorded_dtypes(base_dir, 0) == ("float32", "float32")
        assert "so training computes in float32" in out and "so rollouts decode in float32" in out
    else:
        preference = [torch.float32, torch.bfloat16]
        assert measurements["calls"] == [("training", preference), ("rollouts", preference)]
        assert recorded_dtypes(base_dir, 0) == (name(training), name(rollouts))
        assert f"training computes in {name(training)}" in out and f"rollouts decode in {name(rollouts)}" in out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["none", "avx512-bf16", "amx"])
def test_forced_dtypes_are_not_measured(kind, sft, base_dir, monkeypatch, measurements):
    """--dtype=float32 runs both phases in float32; --dtype=bfloat16 trains in bf16 where it is native (float32
    elsewhere) and lets auto rollouts be measured; --rollout-dtype forces the rollouts. No forced phase is timed."""
    monkeypatch.setenv("NANOCHAT_CPU_BF16", kind)
    native = kind != "none"
    chat_rl.main(AUTO_FLAGS + ["--num-steps=1", "--dtype=float32"])
    assert recorded_dtypes(base_dir, 0) == ("float32", "float32") and measurements["calls"] == []
    measurements["answers"]["rollouts"] = torch.bfloat16
    chat_rl.main(AUTO_FLAGS + ["--num-steps=1", "--dtype=bfloat16", "--overwrite"])
    expected = "bfloat16" if native else "float32"
    assert recorded_dtypes(base_dir, 0) == (expected, expected)
    assert [phase for phase, _ in measurements["calls"]] == (["rollouts"] if native else [])
    chat_rl.main(AUTO_FLAGS + ["--num-steps=1", "--dtype=float32", "--rollout-dtype=bfloat16", "--overwrite"])
    assert recorded_dtypes(base_dir, 0) == ("float32", expected)
    assert len(measurements["calls"]) == (1 if native else 0)


def test_measured_dtypes_are_recorded_and_kept_on_resume(sft, base_dir, monkeypatch, measurements, capsys):
    """The measured choices are recorded in the meta and a resumed run keeps them instead of measuring again
    (timing could come out otherwise)."""
    monkeypatch.setenv("NANOCHAT_CPU_BF16", "avx512-bf16")
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    measurements["answers"].update(training=torch.bfloat16, rollouts=torch.float32)
    chat_rl.main(AUTO_FLAGS + ["--num-steps=3", "--save-every=1"])
    rl_dir = base_dir / "chatrl_checkpoints" / "d2"
    assert recorded_dtypes(base_dir, 1) == ("bfloat16", "float32") and len(measurements["calls"]) == 2
    (rl_dir / "meta_000002.json").unlink()
    (rl_dir / "model_000002.pt").unlink()
    measurements["answers"].update(training=torch.float32, rollouts=torch.bfloat16)  # would flip both if asked
    chat_rl.main(["--resume=d2:1", "--device-type=cpu"])
    assert recorded_dtypes(base_dir, 2) == ("bfloat16", "float32") and len(measurements["calls"]) == 2


def test_decode_modes_train_the_same_model(sft, base_dir, capsys, cpu_graphs):
    """--decode=static (the bucketed step CUDA graphs replay) and --decode=graph (replayed from graphs; here the
    CPU stand-in for CUDA graphs) sample the same rollouts as eager decoding, so two steps of chat_rl write the
    same weights; the mode in use is printed."""
    rl_dir = base_dir / "chatrl_checkpoints" / "d2"
    weights = {}
    for mode in ("eager", "static", "graph"):
        chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", f"--decode={mode}", "--overwrite"])
        assert f"rollouts: {mode} decode step" in capsys.readouterr().out
        weights[mode] = torch.load(rl_dir / "model_000001.pt", weights_only=True)
    assert cpu_graphs.replays > 0
    for mode in ("static", "graph"):
        assert all(torch.equal(weights["eager"][k], weights[mode][k]) for k in weights["eager"])


@pytest.mark.parametrize("correction", ["none", "token-tis"])
def test_sampler_gap_is_in_the_step_line_history_and_report(correction, sft, base_dir, capsys):
    """Every step that trained a token logs the sampler-trainer gap (fp32 here: a few ulps, below helpers.FP32_GAP_BOUND) in its
    line and the run's history, and the report plots it; with a correction, the corrected fraction too."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", f"--rollout-correction={correction}"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("Step ") and "Average reward" in line]
    history = json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000001.json").read_text())["history"]
    trained = [h for h in history if h["rows_trained"] > 0]
    assert len(lines) == 2 and trained
    for h, line in zip(history, lines):
        assert ("Sampler gap: " in line) == (h["sampler_tokens"] > 0)
        assert ("corrected" in line) == (h["sampler_tokens"] > 0 and correction != "none")
    for h in trained:
        assert h["sampler_tokens"] == h["trained_tokens"] and 0 <= h["sampler_gap_mean"] <= h["sampler_gap_max"] <= FP32_GAP_BOUND
        assert h["corrected_fraction"] == 0.0  # no ratio near the cap in fp32
    assert (base_dir / "report" / "chat-rl-sampler-gap.png").exists()


def test_corrections_that_bind_reach_the_loss(sft, base_dir, monkeypatch):
    """token-tis and sequence-mask through chat_rl, with a cap that binds: the sampler's recorded log-probabilities
    of every odd row are lowered by 5 (as if that row had been sampled by another policy), so those rows' tokens
    have weight exp(5) > cap (token-tis: capped to 2) and their sequence ratio exp(5 n) leaves [1/2, 2]
    (sequence-mask: dropped), while even rows keep a gap of fp32 rounding (weight 1). Step 0's rollouts are the
    same in every run, and the loss is linear in the weights: with L_none, L_mask (odd rows dropped, so only
    the even rows' part) the token-tis loss is L_mask + 2 (L_none - L_mask). The corrected fraction is the odd
    rows' share of the trained tokens."""
    import nanochat.rl.rollout
    real = nanochat.rl.rollout.make_question_batch
    odd_tokens = []

    def odd_rows_sampled_elsewhere(*args, **kwargs):
        batch = real(*args, **kwargs)
        batch.sampler_logprobs[1::2] -= 5.0
        trained = (batch.advantages != 0) & (torch.arange(batch.targets.size(0)) % 2 == 1)
        odd_tokens.append(int((batch.targets[trained] >= 0).sum()))
        return batch
    monkeypatch.setattr(nanochat.rl.rollout, "make_question_batch", odd_rows_sampled_elsewhere)
    step0 = {}
    for correction in ("none", "sequence-mask", "token-tis"):
        odd_tokens.clear()
        chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--overwrite", f"--rollout-correction={correction}",
                                      "--rollout-correction-cap=2"])
        meta = json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000000.json").read_text())
        step0[correction] = meta["history"][0]
    none, mask, tis = step0["none"], step0["sequence-mask"], step0["token-tis"]
    tokens = none["trained_tokens"]
    assert 0 < sum(odd_tokens) < tokens and tis["trained_tokens"] == mask["trained_tokens"] == tokens
    for h in (mask, tis):
        assert h["corrected_fraction"] == pytest.approx(sum(odd_tokens) / tokens)
        assert h["sampler_gap_max"] == pytest.approx(5.0, abs=1e-4)
    assert abs(none["loss"] - mask["loss"]) > 1e-4
    assert tis["loss"] == pytest.approx(mask["loss"] + 2 * (none["loss"] - mask["loss"]), rel=1e-5, abs=1e-8)


# the caching allocator's error, and the CUDA runtime's own, which a warm-up stream's creation raised on an H200 with
# the allocator holding the rest (an AcceleratorError, a RuntimeError before torch 2.8)
OUT_OF_MEMORY_ERRORS = [torch.OutOfMemoryError("simulated: the cache does not fit"),
                        getattr(torch, "AcceleratorError", RuntimeError)("CUDA error: out of memory\nSearch for ...")]


@pytest.mark.parametrize("error", OUT_OF_MEMORY_ERRORS, ids=["allocator", "cuda runtime"])
def test_out_of_memory_while_allocating_the_rollout_cache_halves_the_rows(sft, base_dir, monkeypatch, capsys, error):
    """On a GPU the usual out-of-memory is the KV cache's allocation, before any row decodes: the retry still
    knows how many rows were tried (the cache's), halves them until the cache fits, and the step samples what a
    run with that many rows samples (rows do not change what is sampled)."""
    from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
    flags = TINY_RL_FLAGS + ["--num-steps=1", "--num-samples=8", "--device-batch-size=8"]
    chat_rl.main(flags + ["--max-rows=8"])
    reference = capsys.readouterr().out
    real = SharedPromptKVCache.for_model.__func__
    tried = []

    def small_memory(cls, model, batch_size, *args, **kwargs):
        tried.append(batch_size)
        if batch_size > 8:
            raise error
        return real(cls, model, batch_size, *args, **kwargs)
    monkeypatch.setattr(SharedPromptKVCache, "for_model", classmethod(small_memory))
    chat_rl.main(flags + ["--overwrite"])  # 4 questions x 8 samples: 32 rows tried first
    out = capsys.readouterr().out
    assert tried == [32, 16, 8] and "retrying with --max-rows=16" in out and "retrying with --max-rows=8" in out
    reward = lambda text: [line.split("Average reward: ")[1].split(" ")[0] for line in text.splitlines() if "Average reward" in line]
    assert reward(out) == reward(reference) and len(reward(out)) == 1


def test_the_cached_memory_is_given_back_after_the_failed_attempts_tensors_are_gone(monkeypatch):
    """The CUDA runtime's out-of-memory (a stream or workspace made outside the allocator) needs the allocator's
    cached blocks given back to the driver before the retry: only once the failed attempt's tensors, which its
    frames held while the error was raised, are freed, or their blocks stay cached (only runtime errors)."""
    import weakref
    released, held = [], []

    def release(runtime_error):
        released.append((runtime_error, held[-1]() is None))
    monkeypatch.setattr(nc_device, "release_cached_memory", release)

    def attempt(rows):
        cache = torch.zeros(rows, 1000)  # what the failed attempt had allocated when it ran out
        held.append(weakref.ref(cache))
        if rows > 4:  # a fresh error, as a real one is (a shared one would keep the last traceback's frames)
            error = OUT_OF_MEMORY_ERRORS[1 if rows == 16 else 0]
            raise type(error)(*error.args)
        return rows
    assert nc_device.with_fewer_rows_on_oom(attempt, 16, "retrying with --max-rows={rows}") == (4, 4)
    assert released == [(True, True), (False, True)]


def test_other_errors_are_not_taken_for_out_of_memory():
    """Only an out-of-memory is retried with fewer rows: any other CUDA error (or a bug) is raised at once."""
    tried = []

    def attempt(rows):
        tried.append(rows)
        raise getattr(torch, "AcceleratorError", RuntimeError)("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        nc_device.with_fewer_rows_on_oom(attempt, 16, "retrying with --max-rows={rows}")
    assert tried == [16]


@pytest.mark.slow
def test_a_run_captures_its_decode_graphs_in_its_first_step_only(sft, base_dir, tiny_tokenizer, capsys, cpu_graphs,
                                                                  monkeypatch):
    """Issue 35: the static batch is sized once for the run (the task's longest prompt, the rows the memory budget
    holds at that length), so its graphs, all captured when it is made, serve every later step: on GSM8K's
    prompts of varying lengths, with a budget that caps the rows below the step's 16, only step 0 captures. The
    count is in the step line and the history."""
    from nanochat.engine.engine import Engine
    from nanochat.engine.kv_cache import cache_geometry
    from nanochat.rl.rollout import longest_prompt
    from tasks.gsm8k import GSM8K
    longest = longest_prompt(tiny_tokenizer, GSM8K(split="train"), GSM8K(split="test"))
    lengths = {len(tiny_tokenizer.render_for_completion(GSM8K(split="train")[i])) for i in range(12)}
    assert len({n // 64 for n in lengths}) > 1  # the steps' longest prompts fall in different 64-token buckets
    prompt_cap, max_new = -(-longest // 64) * 64, 16
    per_token = cache_geometry(sft).bytes_per_token(torch.float32)
    budget_gb = per_token * (prompt_cap + 6 * (max_new + 2 * prompt_cap / 4)) / 2 ** 30  # about 6 of 16 rows
    engines = []
    monkeypatch.setattr(rl_run, "Engine", lambda *args, **kwargs: engines.append(Engine(*args, **kwargs)) or engines[-1])
    chat_rl.main(["--device-type=cpu", "--dtype=float32", "--num-steps=5", "--examples-per-step=4", "--num-samples=4",
                  "--device-batch-size=2", f"--max-new-tokens={max_new}", "--eval-every=-1", "--decode=graph",
                  f"--memory-budget-gb={budget_gb}", "--save-every=-1"])
    out = capsys.readouterr().out
    assert f"static batch sized for prompts of up to {longest} tokens" in out
    assert engines[0].memory.kept_batch.cache.batch_size < 16  # the budget caps the rows
    lines = [line for line in out.splitlines() if re.match(r"Step \d+/5 \|", line)]
    captures = [int(m.group(1)) if (m := re.search(r", (\d+) CUDA graphs captured \|", line)) else 0 for line in lines]
    assert len(captures) == 5 and captures[0] == cpu_graphs.captures > 0 and captures[1:] == [0, 0, 0, 0], captures
    assert cpu_graphs.replays > 5 * 8  # every later step replayed its graphs
    _, _, meta = load_model("rl", "cpu", "eval")
    assert [h["captures"] for h in meta["history"]] == captures
