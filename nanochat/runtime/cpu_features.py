"""
What this CPU is, where it decides a run's numbers: how it multiplies bf16 (probed, or $NANOCHAT_CPU_BF16), its name,
and the one line a log starts with.
"""

import os
import platform
import re

import torch

from nanochat.errors import UserError

CPU_BF16_KINDS = ("none", "avx512-bf16", "amx")
CPU_BF16_ENV = "NANOCHAT_CPU_BF16"


def cpu_bf16_kind():
    """How this CPU multiplies bf16: "amx" (AMX tiles), "avx512-bf16" (AVX512-BF16 dot products, no AMX) or
    "none". Without either, PyTorch's CPU bf16 matmul takes a slow path, two orders of magnitude slower than fp32
    (docs/performance.md). $NANOCHAT_CPU_BF16 replaces the probe with one of those values, so
    that one machine can run the branches every other CPU kind takes (bf16 then runs, slowly, where the
    chip has no native support: meant for tests on tiny models)."""
    override = os.environ.get(CPU_BF16_ENV, "")
    if not override:
        return probed_cpu_bf16_kind()
    if override not in CPU_BF16_KINDS:
        raise UserError(f"{CPU_BF16_ENV} must be one of {', '.join(CPU_BF16_KINDS)} (or unset to probe the CPU), "
                        f"got {override!r}")
    return override


def probed_cpu_bf16_kind():
    """cpu_bf16_kind as the CPU reports it, whatever the override says."""
    probe = lambda name: getattr(torch.cpu, name, lambda: False)()  # private, so probe before calling
    if probe("_is_amx_tile_supported"):
        return "amx"
    return "avx512-bf16" if probe("_is_avx512_bf16_supported") else "none"


def cpu_name():
    """The CPU's model name ("AMD EPYC 9B14"), from /proc/cpuinfo where there is one."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
    except OSError:  # not Linux
        return name
    return match.group(1).strip() if match else name


def cpu_summary():
    """One line naming what makes this machine's numbers what they are: the CPU, its bf16 support (probed, and
    the $NANOCHAT_CPU_BF16 override if set), torch's version and its thread count."""
    bf16 = probed_cpu_bf16_kind()
    if os.environ.get(CPU_BF16_ENV):
        bf16 = f"{cpu_bf16_kind()} ({CPU_BF16_ENV}; probed: {bf16})"
    return (f"CPU {cpu_name()}, {os.cpu_count()} logical cores | bf16: {bf16} | torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def cpu_has_native_bf16():
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX; see cpu_bf16_kind)."""
    return cpu_bf16_kind() != "none"
