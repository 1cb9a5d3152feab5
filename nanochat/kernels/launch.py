"""
Where the project's Triton kernels run, and how each is launched there: compiled by Triton on a CUDA device; on a
CPU only in Triton's interpreter (TRITON_INTERPRET=1, for tests: numpy runs each program of the grid in turn, far too
slow for a rollout). Triton reads that variable once, when it is imported (its language's library functions are made
compiled or interpreted then), so one process runs the kernels either compiled (a GPU machine) or interpreted (a CPU
with the variable set before Python starts), not both; the kind is picked per call from the tensors' device.
"""

import os
import types

import torch

try:
    import triton
    import triton.language as tl  # noqa: F401 (re-exported: the kernels' modules import it from here)
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # a CPU build of torch without triton: the kernels cannot run, kernels_unavailable says so
    triton = tl = InterpretedFunction = None

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_on():
    """Whether Triton's interpreter can run here: TRITON_INTERPRET=1 was set when triton was imported (its language's
    own library functions are made interpreted or compiled then, once), and is set now."""
    if triton is None or os.environ.get(INTERPRET_ENV, "0") in ("", "0"):
        return False
    return isinstance(tl.standard.sum, InterpretedFunction)


def kernels_unavailable(device):
    """Why the Triton kernels cannot run on `device` (a torch.device), or None when they can."""
    if triton is None:
        return "the Triton kernels need the triton package (it comes with every CUDA build of torch): pip install triton"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreter_on():
        return None
    if device.type == "cpu":
        return (f"the Triton kernels run on a CUDA GPU; on a CPU only in Triton's interpreter "
                f"({INTERPRET_ENV}=1 set before Python starts, slow: for tests), not on here")
    return f"the Triton kernels run on a CUDA GPU (or a CPU in Triton's interpreter), not on {device.type}"


class Kernel:
    """A Triton kernel function, launched as `kernel.on(device)[grid](*args)`: compiled on CUDA tensors, interpreted on
    CPU tensors (the module docstring). Written as a plain function and wrapped here once per kind. A Kernel that
    another one calls (a helper) is what that kind calls: a jit function where Triton compiles, the plain function
    where the interpreter runs (it cannot call a jit function)."""

    def __init__(self, fn):
        self.fn, self.compiled, self.interpreted = fn, None, None

    def on(self, device):
        if device.type == "cuda":
            if self.compiled is None:
                self.compiled = triton.jit(self._with_helpers(compiled=True))
            return self.compiled
        if self.interpreted is None:
            self.interpreted = InterpretedFunction(self._with_helpers(compiled=False))
        return self.interpreted

    def _with_helpers(self, compiled):
        """fn reading its helper Kernels as the given kind (a copy of fn with those globals swapped)."""
        helpers = {name: value for name, value in self.fn.__globals__.items()
                   if isinstance(value, Kernel) and name in self.fn.__code__.co_names}
        if not helpers:
            return self.fn
        scope = dict(self.fn.__globals__)
        for name, helper in helpers.items():
            scope[name] = helper.on(torch.device("cuda")) if compiled else helper._with_helpers(False)
        fn = types.FunctionType(self.fn.__code__, scope, self.fn.__name__, self.fn.__defaults__, self.fn.__closure__)
        fn.__module__, fn.__qualname__ = self.fn.__module__, self.fn.__qualname__
        return fn


def kernel(fn):
    """Decorator: fn as a Kernel (Triton's jit or interpreter, by device)."""
    return Kernel(fn)


def block_size(n, floor=16):
    """The power of two >= n that a Triton block of n elements takes (at least `floor`: tl.dot wants 16)."""
    return max(floor, triton.next_power_of_2(n)) if triton is not None else max(floor, 1 << (max(n, 1) - 1).bit_length())
