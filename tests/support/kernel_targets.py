"""
Where the kernels' tests run: one test body, two targets. `cpu`: Triton's interpreter on CPU tensors (where
TRITON_INTERPRET=1, triton 3.9 or later), under the bounds harness (every load and store checked inside its
argument's extent) and with the interpreter's bf16 and tl.dot made a GPU's (launched_numerics); `cuda`: compiled by
Triton on CUDA tensors (marked `cuda`, where a GPU is). A test takes the `target` fixture and builds its tensors on
target.device; target.memory is the harness's record of the launches (None on CUDA: nothing to check there).

And the bounds the tests hold the kernels to, from the arithmetic: `ulps(values, dtype)` is one unit in the last
place of each value in `dtype` (eps times the power of two at or below it), so a bound reads "n roundings of the
value" rather than a number.
"""

from dataclasses import dataclass

import pytest
import torch
from bounds_harness import checked_memory
from helpers import HAS_CUDA
from launched_numerics import launched_numerics

from nanochat.kernels.launch import interpreter_on, triton

TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2]) if triton else (0, 0)
# Triton 3.9's interpreter or later: 3.6's (the GPU image's) holds a loaded scalar as a 1-element array, which a loop
# bound cannot be (its compiler takes the same kernels: tests/support/sm90_compile.py passes under 3.6.0 and 3.9.0)
INTERPRETER_SKIP = pytest.mark.skipif(not interpreter_on() or TRITON_VERSION < (3, 9),
                                      reason="Triton's interpreter (3.9 or later) is off: a GPU machine compiles")
TARGETS = [pytest.param("cpu", marks=INTERPRETER_SKIP, id="interpreter"),
           pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")],
                        id="cuda")]


@dataclass
class Target:
    device: torch.device
    memory: object  # bounds_harness.Memory in the interpreter, None compiled

    @property
    def interpreted(self):
        return self.device.type == "cpu"


@pytest.fixture(params=TARGETS)
def target(request):
    device = torch.device(request.param)
    if device.type == "cuda":
        # the torch references' fp32 matmuls in fp32, not tf32 (compute_init turns tf32 on for a run's process)
        tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
        try:
            yield Target(device, None)
            torch.cuda.synchronize()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        return
    with checked_memory() as memory, launched_numerics():
        yield Target(device, memory)


def ulps(values, dtype):
    """One unit in the last place of each of `values` (a tensor, any dtype) in `dtype`: eps(dtype) * 2^floor(log2|v|),
    at least the smallest normal's."""
    magnitude = values.detach().float().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(magnitude)))


def assert_within_ulps(got, want, dtype, n, scale=None):
    """|got - want| <= n ulps (in `dtype`) of max(|want|, scale): `n` roundings of the value; `scale` the magnitude
    of the terms a value was summed from, where their rounding errors, not the value's, bound the difference (a sum
    that cancels)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    size = want.abs() if scale is None else torch.maximum(want.abs(), torch.as_tensor(scale, dtype=torch.float32).cpu())
    bound = n * ulps(size, dtype)
    excess = ((got - want).abs() - bound).nan_to_num(nan=float("inf"))  # a NaN is as far as it gets
    worst = int(excess.flatten().argmax())
    assert bool((excess <= 0).all()), (
        f"{int((excess > 0).sum())} of {excess.numel()} values more than {n} {dtype} ulps apart; the worst at flat "
        f"index {worst}: got {got.flatten()[worst].item()!r}, want {want.flatten()[worst].item()!r}, bound "
        f"{bound.flatten()[worst].item():.3g}")
