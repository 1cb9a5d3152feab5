"""
The dtypes a run computes in where that is a measured choice.

On a GPU bf16 autocast is simply faster. On a CPU it depends on the chip and on the work: without AVX512-BF16
or AMX, bf16 matmuls take a slow path (never chosen; see dtypes.compute_dtype); with AVX512-BF16 but no AMX,
a small model's training step can be slower in bf16 than in fp32 (it was with PyTorch's fused bf16 attention;
written out since, it is faster than fp32 on an AVX512-BF16 CPU) while a large decode batch may gain;
with AMX bf16 usually wins. So a run that may use bf16 on a CPU or MPS times one step of its own work each way at its
start, and keeps fp32 (nanochat's CPU numerics) unless bf16 is clearly faster. The choice is made on rank 0
and every rank takes it, so that all ranks compute alike. fp16 is never measured: it is asked for (--dtype=float16),
or auto's choice on a CUDA GPU without native bf16 (dtypes.compute_dtype), and trains with loss scaling
(nanochat/optim/loss_scale.py). Also here: whether autocast is on, and its weight-cast cache turned off, as compiled
code needs them asked and set.
"""

import contextlib
import time

import torch
import torch.distributed as dist

from nanochat.runtime.device import synchronize
from nanochat.runtime.dtypes import autocast_context

# bf16 replaces fp32 only when this many times faster: timing noise on a busy machine must not flip a close
# call from one run to the next
MARGIN = 1.2
PREFERENCE = (torch.float32, torch.bfloat16)  # the preferred first


def fastest_dtype(make_step, candidates, device, repeats=3, margin=MARGIN):
    """Of `candidates` (torch dtypes, the preferred first), the one under whose autocast one call of the step
    runs fastest on `device`. make_step(dtype), called under that autocast, prepares and returns the step (a
    no-argument callable); it is called once to warm up, then `repeats` times timed, and the best time counts.
    Another candidate replaces the first only when faster by `margin`. One candidate is returned untimed."""
    if len(candidates) == 1:
        return candidates[0]
    best = {}
    for dtype in candidates:
        with autocast_context(device, dtype):
            step = make_step(dtype)
            step()  # warm-up: first calls allocate and pick kernels
            times = []
            for _ in range(repeats):
                synchronize(device)
                t0 = time.perf_counter()
                step()
                synchronize(device)
                times.append(time.perf_counter() - t0)
        best[dtype] = min(times)
    fastest = min(candidates, key=best.get)
    return fastest if best[fastest] * margin < best[candidates[0]] else candidates[0]


def random_tokens(model, rows, length):
    """(rows, length) token ids drawn from a fixed generator: the same timing input in every run, and the
    global random state untouched (the run's sampling depends on it)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(0, model.config.vocab_size, (rows, length), generator=gen).to(model.get_device())


def fastest_rollout_dtype(engine, prompts, num_samples, candidates, max_tokens=16, repeats=2, margin=MARGIN):
    """The dtype (of `candidates`, see fastest_dtype) in which `engine` samples `num_samples` completions of up to
    `max_tokens` tokens for each of `prompts` (token lists) fastest: the run's own rollout (its cache, its rows,
    its sampler), shortened. Measured so because the answer depends on all three: on an AVX512-BF16 CPU a
    copy-cache decode step of a few rows can be faster in bf16 and one of hundreds of rows slower, while the
    shared-prompt cache's steps over hundreds of rows (what chat_rl's rollouts run) are faster in bf16."""
    def make_step(dtype):
        return lambda: engine.generate_many(prompts, num_samples=num_samples, max_tokens=max_tokens, top_k=50, seed=0)

    with torch.no_grad():
        return fastest_dtype(make_step, candidates, engine.model.get_device(), repeats, margin)


def fastest_training_dtype(model, rows, length, candidates, repeats=2, margin=MARGIN):
    """The dtype (of `candidates`, see fastest_dtype) in which one training micro-batch of `model` (forward and
    backward of `rows` sequences of `length` tokens) runs fastest. The gradients it makes are discarded."""
    length = max(2, min(length, model.config.sequence_len))
    tokens = random_tokens(model, rows, length + 1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    was_training = model.training
    model.train()

    def make_step(dtype):
        def step():
            model(inputs, targets).backward()
            model.zero_grad(set_to_none=True)
        return step

    try:
        return fastest_dtype(make_step, candidates, model.get_device(), repeats, margin)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def rank0_choice(choose, candidates):
    """candidates[i] for the i that choose() returns on rank 0; the other ranks do not call it and wait for
    rank 0's answer. A CPU tensor: only CPU and MPS runs measure, and their process group is gloo."""
    index = torch.tensor([candidates.index(choose()) if not dist.is_initialized() or dist.get_rank() == 0 else 0])
    if dist.is_initialized():
        dist.broadcast(index, src=0)
    return candidates[int(index)]


def ortho_dtype(name):
    """The dtype Muon orthogonalizes in for a run computing in `name` ("float32", "bfloat16", "float16"): the compute
    dtype, as nanochat ties them, except fp32 for fp16: Muon's Newton-Schulz iteration runs in bf16 or fp32 (the
    optimizers accept those), and a GPU without native bf16, fp16's reason to be, has no fast bf16 for it."""
    return torch.float32 if name == "float16" else getattr(torch, name)


def autocast_enabled(device_type):
    """Whether autocast is on for `device_type`; False on the meta device (op counts), which has no autocast to ask.
    Not torch.amp.is_autocast_available: torch 2.11's Dynamo cannot trace it, and a compiled step calls this."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def without_autocast(device_type):
    """A context with autocast off where it is on (on the meta device, op counts, there is none to turn off): for
    computations that pick their own dtypes (fp32 attention scores)."""
    return torch.autocast(device_type, enabled=False) if autocast_enabled(device_type) else contextlib.nullcontext()


@contextlib.contextmanager
def autocast_cache_off():
    """Autocast's weight-cast cache off inside (a global switch): a CUDA graph's capture needs it off, and
    torch.compile guards on it, so a step compiled with it on compiled again when captured (every graph twice, on an
    H200). The decode step runs with it off everywhere; its weights are cast once already."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)
