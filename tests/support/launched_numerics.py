"""
Triton's interpreter computing bf16 and tl.dot as a compiled kernel does on a GPU (tests only).

What the interpreter (triton 3.9) does differently, each shown by tests/kernels/test_bounds_harness.py:
- tl.dot of bf16 tiles: it keeps bf16 as its raw bits in uint16 arrays and hands them to np.matmul, which multiplies
  the integers (1.0 is 0x3F80 = 16256): garbage. A GPU multiplies the bf16 values exactly and sums in fp32. Here both
  operands are widened to fp32 first (exact: a bf16 is an fp32 with 16 bits dropped), then multiplied in fp32.
- tl.dot of fp32 tiles at the default input precision (tf32): it multiplies in full fp32; a GPU's tensor cores take
  the operands rounded to tf32 (10 mantissa bits). Here they are rounded so (as the interpreter's own TMA path does),
  so a kernel that forgets input_precision="ieee" is as wrong here as there.
- fp32 -> bf16 (`x.to(tl.bfloat16)`, a store into a bf16 tensor, a bf16 constant): it truncates toward zero; a GPU's
  cvt.rn rounds to nearest even, as torch does. Here torch's conversion does it.
- tl.argmax / tl.argmin without tie_break_left: it returns the first of equal extremes; a GPU any of them (the
  reduction tree's). Here the last, so that a kernel counting on the first is caught as it would be there.

    with launched_numerics():
        out = some_op(bf16 tensors)   # the kernel's bf16 path runs as launched
"""

import contextlib

import numpy as np
import torch
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime import interpreter

import nanochat.kernels.prompt_attention as prompt_attention_module


def bf16_bits_to_fp32(bits):
    """uint16 bf16 bit patterns -> their fp32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(values):
    """fp32 values -> bf16 bit patterns rounded to nearest even (torch's, and a GPU's cvt.rn)."""
    as_tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return as_tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _dot_operand(handle, input_precision):
    if handle.dtype.scalar == tl.bfloat16:
        return bf16_bits_to_fp32(handle.data)
    if handle.dtype.scalar == tl.float32 and input_precision == ir.INPUT_PRECISION.TF32:
        return interpreter._round_f32_to_tf32(handle.data)
    return handle.data


def _launched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.dtype.scalar not in (tl.bfloat16, tl.float32) or b.dtype.scalar not in (tl.bfloat16, tl.float32):
        return _ORIGINAL["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
    product = np.matmul(_dot_operand(a, input_precision), _dot_operand(b, input_precision), dtype=np.float32)
    return interpreter.TensorHandle((product + d.data).astype(d.data.dtype), d.dtype.scalar)


def _launched_cast(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        return interpreter.TensorHandle(fp32_to_bf16_bits(src.data).reshape(np.shape(src.data)), tl.bfloat16)
    return _ORIGINAL["cast_impl"](self, src, dst_type)


def _last_index(index_of_first):
    """An arg-reduction returning the last index of the extreme instead of the first."""
    def index(data, axis, keepdims):
        flipped = np.flip(data, axis=axis)
        length = data.size if axis is None else data.shape[axis]
        return length - 1 - index_of_first(flipped, axis=axis, keepdims=keepdims)
    return index


def _launched_reduce(self, input):
    fast = [(tl.standard._argmax_combine_tie_break_fast, np.nanmax, np.nanargmax),
            (tl.standard._argmin_combine_tie_break_fast, np.nanmin, np.nanargmin)]
    for combine, value, index in fast:
        if self.combine_fn is combine:
            return self.min_max(input[0], val_reduce_op=value, idx_reduce_op=_last_index(index))
    return _ORIGINAL["reduce"](self, input)


_ORIGINAL = {}  # the interpreter's own methods, read when launched_numerics is entered (on a GPU machine's Triton,
# whose interpreter may lack some of them, importing this module must not fail)


@contextlib.contextmanager
def launched_numerics():
    """Within the block the interpreter's tl.dot, fp32 -> bf16 and fast arg-reductions are a GPU's (the module
    docstring), and prompt_attention hands its kernel bf16 tiles as they are (no fp32 copies:
    INTERPRETER_BF16_DOT_FIXED)."""
    builder = interpreter.InterpreterBuilder
    before = prompt_attention_module.INTERPRETER_BF16_DOT_FIXED
    _ORIGINAL.update(create_dot=builder.create_dot, cast_impl=builder.cast_impl,
                     reduce=interpreter.ReduceOps.apply_impl)
    try:
        builder.create_dot, builder.cast_impl = _launched_dot, _launched_cast
        interpreter.ReduceOps.apply_impl = _launched_reduce
        prompt_attention_module.INTERPRETER_BF16_DOT_FIXED = True
        yield
    finally:
        builder.create_dot, builder.cast_impl = _ORIGINAL["create_dot"], _ORIGINAL["cast_impl"]
        interpreter.ReduceOps.apply_impl = _ORIGINAL["reduce"]
        prompt_attention_module.INTERPRETER_BF16_DOT_FIXED = before
