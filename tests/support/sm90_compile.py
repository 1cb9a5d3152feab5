"""Compiles each of nanochat/kernels/' Triton kernels for an sm_90 GPU (H100/H200) on this machine, GPU or not, at the
d20 decode step's sizes and the other branches the engine takes (GQA groups of 2 and 32, greedy, no top-k, no value
embedding, the norm's two roundings, each residual part off), bf16 and fp32, and assembles each with Triton's own
ptxas; prints `<kernel> <dtype> <variant> ok <registers> registers`, or fails where a kernel does not compile or
spills registers to local memory. Run by tests/kernels/test_triton_kernels.py in a process of its own: Triton
compiles only where its interpreter is off."""

import inspect
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
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
            parts = name.startswith("part_")  # the own-key attention's parts: fp32 whatever the data's dtype
            out[name] = "*i32" if name == "cells_ptr" else "*i64" if integer else "*fp32" if parts else pointer_type
        else:
            out[name] = "fp32" if name in FLOATS else "i32"
    return out


def cases(dtype):
    attention = dict(REP=1, D=128, BLOCK_CELLS=16, BLOCK_REP=1, BLOCK_D=128, BLOCK_N=16, BLOCK_FREE=pa.FREE_ROWS_BLOCK,
                     IEEE=dtype == "fp32")
    own = dict(REP=1, D=128, BLOCK_REP=1, BLOCK_D=128, BLOCK_OWN=pa.own_keys_a_tile(1))
    rotary = dict(D=128, BLOCK_HEADS=32, BLOCK_D=128, HAS_VE=True, BLOCK_CH=16, NORM_FP32=False)
    residual = dict(ROWS=4, BLOCK_C=2048, HAS_DELTA=True, HAS_A=True, HAS_Y=True, KEEP_SUM=True)
    sample = dict(BLOCK=1024, GREEDY=False, TOP_K=True, SCALE=True)
    return [(pa._prompt_attention_kernel, "d20", attention),
            (pa._prompt_attention_kernel, "gqa", {**attention, "REP": 2, "BLOCK_CELLS": 8, "BLOCK_REP": 2}),
            (pa._prompt_attention_kernel, "group of 32", {**attention, "REP": 32, "BLOCK_CELLS": 1, "BLOCK_REP": 32}),
            (pa._own_keys_kernel, "d20", own),
            (pa._own_keys_kernel, "gqa", {**own, "REP": 2, "BLOCK_REP": 2, "BLOCK_OWN": pa.own_keys_a_tile(2)}),
            (pa._own_keys_kernel, "group of 32", {**own, "REP": 32, "BLOCK_REP": 32, "BLOCK_OWN": pa.own_keys_a_tile(32)}),
            (rs._rotary_store_kernel, "value embedding", rotary),
            (rs._rotary_store_kernel, "fp32 norm, none", {**rotary, "HAS_VE": False, "NORM_FP32": True}),
            (rn._residual_norm_kernel, "all parts", residual),
            (rn._residual_norm_kernel, "norm only", {**residual, "HAS_DELTA": False, "HAS_A": False, "HAS_Y": False,
                                                     "KEEP_SUM": False}),
            (rn._relu_square_kernel, "", dict(BLOCK=1024)),
            (sa._sample_kernel, "top-k", sample),
            (sa._sample_kernel, "greedy", {**sample, "GREEDY": True, "TOP_K": False, "SCALE": False}),
            (sa._sample_kernel, "all logits", {**sample, "TOP_K": False, "SCALE": False})]


def registers_and_spills(ptx):
    """(registers, spill stores + loads in bytes) ptxas reports for the kernel in `ptx` at sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


if __name__ == "__main__":
    for dtype in ("bf16", "fp32"):
        for wrapped, variant, constants in cases(dtype):
            pointer = "*fp32" if wrapped is sa._sample_kernel else f"*{dtype}"
            source = ASTSource(wrapped.on(torch.device("cuda")), signature(wrapped.fn, pointer, constants), constants)
            rows = constants.get("BLOCK_CELLS", 1) * constants.get("BLOCK_REP", 1)  # as each is launched:
            warps = {pa._prompt_attention_kernel: pa.attention_warps(rows), pa._own_keys_kernel: pa.OWN_WARPS}.get(wrapped, 4)
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
            assert ".entry" in ptx, wrapped.fn.__name__
            registers, spills = registers_and_spills(ptx)
            assert spills == 0, f"{wrapped.fn.__name__} {dtype} {variant}: {spills} bytes of register spills"
            print(wrapped.fn.__name__, dtype, variant, "ok", registers, "registers", flush=True)
