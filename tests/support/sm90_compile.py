"""Compiles each of nanochat/kernels/' Triton kernels for an sm_90 GPU (H100/H200) on this machine, GPU or not, at the
d20 decode step's sizes, bf16 and fp32; prints `<kernel> <dtype> ok` for each, or fails. Run by
tests/kernels/test_triton_kernels.py in a process of its own: Triton compiles only where its interpreter is off."""

import inspect

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanochat.kernels import prompt_attention as pa, residual_norm as rn, rotary_store as rs, sampling as sa

INTEGER_POINTERS = ("len", "pos", "sample", "seeds", "draws", "active", "indices", "positions", "tokens")
FLOATS = ("scale", "qk_scale", "eps", "sign", "temperature", "ve_scale")


def signature(fn, pointer_type, constants):
    """Triton's signature of `fn`: data pointers of pointer_type, index pointers int64 (cells int32), ints, the
    scales fp32, constexprs from `constants`."""
    out = {}
    for name in inspect.signature(fn).parameters:
        if name in constants:
            out[name] = "constexpr"
        elif name.endswith("_ptr"):
            integer = any(s in name for s in INTEGER_POINTERS)
            out[name] = "*i32" if name == "cells_ptr" else "*i64" if integer else pointer_type
        else:
            out[name] = "fp32" if name in FLOATS else "i32"
    return out


def cases(dtype):
    return [(pa._prompt_attention_kernel, dict(REP=1, D=128, BLOCK_CELLS=16, BLOCK_REP=1, BLOCK_D=128, BLOCK_N=16,
                                               BLOCK_OWN=8, BLOCK_FREE=64, IEEE=dtype == "fp32")),
            (rs._rotary_store_kernel, dict(D=128, BLOCK_HEADS=32, BLOCK_D=128, HAS_VE=True, BLOCK_CH=16)),
            (rn._residual_norm_kernel, dict(ROWS=4, BLOCK_C=2048, HAS_DELTA=True, HAS_A=True, HAS_Y=True,
                                            KEEP_SUM=True)),
            (rn._relu_square_kernel, dict(BLOCK=1024)),
            (sa._sample_kernel, dict(BLOCK=1024, GREEDY=False, TOP_K=True, SCALE=True))]


if __name__ == "__main__":
    for dtype in ("bf16", "fp32"):
        for wrapped, constants in cases(dtype):
            pointer = "*fp32" if wrapped is sa._sample_kernel else f"*{dtype}"
            source = ASTSource(wrapped.on(torch.device("cuda")), signature(wrapped.fn, pointer, constants), constants)
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
            assert ".entry" in ptx, wrapped.fn.__name__
            assert ".local" not in ptx, f"{wrapped.fn.__name__} {dtype} spills registers to local memory"
            print(wrapped.fn.__name__, dtype, "ok", flush=True)
