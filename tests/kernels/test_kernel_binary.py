"""What the sm_90 compile of the kernels stands on (nanochat/diagnostics/kernel_binary.py): launches recorded without
running, jit copies that keep their constexprs, the occupancy arithmetic; and the kernels' 64-bit offsets, run in
Triton's interpreter past 2^31 elements (tests/support/wide_offsets.py)."""

import inspect
import os
import subprocess
import sys

import pytest
import torch
from helpers import PYTHONPATH, SUPPORT

triton = pytest.importorskip("triton", reason="the kernels' tests need triton (tests/run.sh installs it)")
from nanochat.diagnostics.kernel_binary import occupancy  # noqa: E402
from nanochat.kernels import prompt_attention, residual_norm, rotary_store, sampling  # noqa: E402
from nanochat.kernels.launch import Kernel, recording_launches  # noqa: E402

KERNEL_MODULES = (prompt_attention, residual_norm, rotary_store, sampling)


def test_recorded_launches_bind_without_running():
    """Under recording_launches an op records its launch (kernel, grid, arguments) and runs nothing: sample_rows'
    streams are not advanced. Runs where no interpreter or GPU is."""
    B, V = 3, 40
    logits, draws = torch.randn(B, V), torch.zeros(B, dtype=torch.long)
    sampled = torch.zeros(B, 3)
    with recording_launches() as records:
        sampling.sample_rows(logits, None, None, torch.arange(B), draws, torch.ones(B, dtype=torch.long), sampled, 0.0)
    assert [(r.kernel, r.grid) for r in records] == [(sampling._sample_kernel, (B,))]
    assert records[0].args[0] is logits and records[0].kwargs["GREEDY"] is True
    assert torch.equal(draws, torch.zeros(B, dtype=torch.long)) and torch.equal(sampled, torch.zeros(B, 3))


def test_kernels_calling_helpers_keep_their_constexpr_annotations():
    """The copy of a kernel that reads its helper Kernels (Kernel._with_helpers) has the kernel's parameters, their
    tl.constexpr annotations included: Triton's jit knows a constexpr only by it (without, prompt_attention's and the
    sampler's block sizes bound as ints on a GPU and did not compile)."""
    kernels = [k for m in KERNEL_MODULES for k in vars(m).values() if isinstance(k, Kernel)]
    with_helpers = [k for k in kernels if k._with_helpers(compiled=False) is not k.fn]
    assert {k.fn.__name__ for k in with_helpers} >= {"_prompt_attention_kernel", "_sample_kernel"}
    for k in with_helpers:
        assert inspect.signature(k._with_helpers(compiled=False)) == inspect.signature(k.fn), k.fn.__name__


@pytest.mark.parametrize("registers,threads,shared,expected", [
    (95, 256, 20992, (2, "registers")),     # d20's bf16 attention: 96 x 32 = 3072 a warp, 21 warps, 2 blocks of 8
    (14, 128, 0, (16, "threads")),          # relu_square: 2048 threads / 128
    (16, 32, 0, (32, "blocks")),            # one warp of 16 registers: the 32 blocks an SM holds
    (40, 128, 60 * 1024, (3, "shared memory")),  # 228 KB / (60 KB + 1 KB reserved a block)
    (255, 128, 0, (2, "registers")),        # 256 x 32 = 8192 a warp: 8 warps
    (41, 512, 0, (2, "registers")),         # 1312 a warp rounded up to 1536: 42 warps (49 unrounded: 3 blocks)
])
def test_occupancy_on_sm90(registers, threads, shared, expected):
    assert occupancy(registers, threads, shared) == expected


@pytest.mark.skipif(tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9),
                    reason="Triton's interpreter before 3.9 cannot run the kernels (test_triton_kernels.py)")
def test_offsets_past_2_to_the_31_are_64_bit():
    """rotary_store writing a KV cache, sample_rows reading logits, and prompt_attention's two kernels reading queries,
    own keys and values and prompt slots, whose rows are 2^30 + 2^20 elements apart (row 2 past 2^31), write what
    they write on contiguous copies (tests/support/wide_offsets.py, in Triton's interpreter in a process of its own:
    with 32-bit offsets row 2's address wraps below the tensor and the process crashes)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": PYTHONPATH}
    done = subprocess.run([sys.executable, str(SUPPORT / "wide_offsets.py")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.splitlines() == ["rotary_store ok", "sample_rows ok", "own_key_attention ok",
                                        "prompt_attention ok"]
