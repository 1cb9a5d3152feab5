"""
The dtype a run computes in: what --dtype or $NANOCHAT_DTYPE asks for, what that becomes on a device before any
measurement (nanochat.model.precision measures where it is a choice), its name in configs and checkpoints, and the
autocast context that applies it.
"""

import contextlib
import os

import torch

from nanochat.errors import SettingError, UserError
from nanochat.runtime.cpu_features import cpu_has_native_bf16
from nanochat.runtime.distributed import print0

DTYPES = ("auto", "float32", "bfloat16", "float16")


def requested_dtype(dtype, float16=False):
    """The precision a run asks for: `dtype` when given (the --dtype flag; None = not given), else
    $NANOCHAT_DTYPE (how current nanochat sets it), else "auto": bf16 where it is fast (on a CPU or MPS the
    scripts that measure decide; see nanochat.model.precision). float16 only for a script that trains in it with
    loss scaling (float16=True: chat_rl). Another value is a UserError naming where it came from (a SettingError
    for `dtype`)."""
    env = os.environ.get("NANOCHAT_DTYPE")
    if dtype is not None:
        value = dtype
    elif env:
        value = env
    else:
        return "auto"
    allowed = DTYPES if float16 else DTYPES[:3]
    if value not in allowed:
        problem = f"must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}"
        if value == "float16":
            problem += " (float16 training needs loss scaling, which only chat_rl has; use bfloat16 or float32)"
        raise SettingError("dtype", problem) if dtype is not None else UserError(f"NANOCHAT_DTYPE {problem}")
    return value


def cuda_has_native_bf16(device):
    """True when the CUDA `device` multiplies bf16 natively (Ampere, SM 80, and later): a V100, a T4 or an RTX 20xx
    has only fp16 tensor cores, where bf16 is emulated, if it runs at all."""
    return torch.cuda.is_bf16_supported(including_emulation=False) if device.type == "cuda" else False


def compute_dtype(device, requested, what="computing", float16=False):
    """The autocast dtype for `requested` ("auto" | "bfloat16" | "float32" | "float16") on `device`, before any
    measurement: float32 or float16 when asked; else bf16, except on a CPU without native bf16, which computes in
    float32 instead (a note says so, naming `what`), since bf16 there would make the run ~100x slower, and, for a
    caller that can train in fp16 (float16=True: chat_rl, with loss scaling), auto on a CUDA GPU without native
    bf16, which computes in float16 (a note says so)."""
    if requested in ("float32", "float16"):
        return getattr(torch, requested)
    if device.type == "cpu" and not cpu_has_native_bf16():
        print0(f"note: this CPU has no native bf16 (no AVX512-BF16 or AMX), so {what} in float32 instead of bfloat16")
        return torch.float32
    if float16 and requested == "auto" and device.type == "cuda" and not cuda_has_native_bf16(device):
        print0(f"note: this GPU has no native bf16 (before SM 80), so {what} in float16 instead of bfloat16 "
               "(--dtype to choose)")
        return torch.float16
    return torch.bfloat16


def dtype_name(dtype):
    """torch.bfloat16 -> "bfloat16": how configs and checkpoints record a dtype."""
    return str(dtype).removeprefix("torch.")


def autocast_context(device, dtype):
    """bf16 or fp16 autocast on `device`, or nothing for float32 (weights are float32 either way)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.amp.autocast(device_type=device.type, dtype=dtype)
