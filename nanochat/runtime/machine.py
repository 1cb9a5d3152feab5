"""
What this machine can do, measured or read where a benchmark runs: the matmul peak (the denominator of MFU), the
memory bandwidth (the bound of a memory-bound decode step), the peak memory of a stretch of work, and a description
of the machine and its load (so that a figure can be told apart from the machine it was measured on).
"""

import collections
import ctypes
import gc
import math
import os
import platform
import re
import resource
import time

import torch

from nanochat.runtime.cpu_features import cpu_bf16_kind, cpu_name
from nanochat.runtime.device import synchronize
from nanochat.runtime.distributed import print0


def device_time(device):
    """time.perf_counter() once the device has done the work queued on it (a GPU runs asynchronously): what a timing
    on this machine reads, before and after the work it times."""
    synchronize(device)
    return time.perf_counter()


def memory_bandwidth(device, megabytes=512, reps=5):
    """Best bytes/s of copying a `megabytes` tensor on the device (read + write counted): what a step that reads
    every weight once (a decode step) is bounded by."""
    src = torch.empty(megabytes * 2 ** 20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        t0 = device_time(device)
        dst.copy_(src)
        best = min(best, device_time(device) - t0)
    return 2 * src.numel() * 4 / best


def matmul_peak_flops(device, dtype, size, reps=10, warmup=2):
    """Best FLOP/s of an n x n @ n x n matmul (2 n^3 FLOPs) in `dtype` over `reps` timed runs after `warmup` runs:
    the peak that MFU divides by, measured rather than taken from a datasheet, so that it holds on any CPU or GPU."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(warmup):
        a @ b
    synchronize(device)
    best = math.inf
    for _ in range(reps):
        t0 = device_time(device)
        a @ b
        best = min(best, device_time(device) - t0)
    return 2 * size ** 3 / best


def _proc_status_kb(field):
    """A "<field>: N kB" line of /proc/self/status (VmRSS, VmHWM), in kB; None if absent."""
    match = re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.MULTILINE)
    return int(match.group(1)) if match else None


class PeakMemory:
    """Peak memory over a stretch of work, resettable between stretches (a benchmark's configurations).

    CUDA: the caching allocator's peak (torch.cuda.max_memory_allocated). Elsewhere the peak resident set:
    on Linux VmHWM from /proc/self/status, whose peak is reset to the current RSS by writing "5" to
    /proc/self/clear_refs; glibc's malloc_trim first returns the previous stretch's freed heap to the
    OS, so the peak is this stretch's working set plus what stays resident (weights, data, imports).
    Without clear_refs (macOS, locked-down kernels) it is ru_maxrss: the peak since the process started.
    torch's CPU allocations bypass Python's allocator, so tracemalloc cannot see them."""

    def __init__(self, device):
        self.device = device
        self._trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if platform.system() == "Linux" else None
        if device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated, reset per config"
        elif self._can_reset_rss():
            self.method = ("peak RSS (VmHWM), reset per config via /proc/self/clear_refs"
                           + (" after malloc_trim" if self._trim else ""))
        else:
            self.method = "ru_maxrss: peak RSS since process start (this OS cannot reset it)"

    def _can_reset_rss(self):
        if not os.path.exists("/proc/self/status") or _proc_status_kb("VmHWM") is None:
            return False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return True

    def reset(self):
        """Start a new peak; returns the memory in use now, in MB."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device) / 2 ** 20
        if self.method.startswith("peak RSS"):
            if self._trim:
                self._trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _proc_status_kb("VmRSS") / 1024
        return self.peak_mb()

    def peak_mb(self):
        """The peak since the last reset (ru_maxrss: since the process started), in MB."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2 ** 20
        if self.method.startswith("peak RSS"):
            return _proc_status_kb("VmHWM") / 1024
        scale = 1 if platform.system() == "Darwin" else 1024  # ru_maxrss is bytes on macOS, KB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2 ** 20


def machine_info(device):
    """The machine a measurement ran on (torch, threads, CPU and its bf16 support, GPU, OS, Python), for its report."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "cpu": cpu_name(),
            "cpu_bf16": cpu_bf16_kind(),
            "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "platform": platform.platform(), "python": platform.python_version()}


def load_average():
    """The 1, 5 and 15 minute load averages (None where the OS has none): other work on a shared machine slows a
    measurement down, and this says how much there was."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def measure_machine(device, dtypes, matmul_size):
    """Describe this machine and measure what a benchmark divides by: the matmul peak in each of `dtypes` (names,
    e.g. "float32") and the memory bandwidth, each printed. Returns (machine_info with the load average before the
    work, {dtype: peak FLOP/s}, bandwidth in bytes/s)."""
    info = {**machine_info(device), "load_average_before": load_average()}
    print0(f"torch {info['torch']}, {info['threads']} threads, {info['cpu']}, load average {info['load_average_before']}")
    peaks = {name: matmul_peak_flops(device, getattr(torch, name), matmul_size) for name in dtypes}
    print0(f"matmul peak ({matmul_size}^2): " + ", ".join(f"{n} {p / 1e12:.3f} TFLOP/s" for n, p in peaks.items()))
    bandwidth = memory_bandwidth(device)
    print0(f"memory bandwidth (device copy): {bandwidth / 1e9:.1f} GB/s")
    return info, peaks, bandwidth


def covered_length(intervals, start, end):
    """How much of [start, end) at least one of `intervals` ((begin, end) pairs, in any order, overlapping or not)
    covers: a GPU's busy time in a window, its kernels being the intervals (overlapping kernels count once)."""
    covered, reach = 0, start
    for begin, finish in sorted(intervals):
        begin, finish = max(begin, reach), min(finish, end)
        if finish > begin:
            covered += finish - begin
            reach = finish
    return covered


def profile_split(events, phases):
    """Where each phase of a torch.profiler run (its raw events: profiler_events) (a record_function range named in `phases`, which ends once the device
    has finished its work) spent its time: {phase: {wall_s, gpu_busy_s, gaps_s, gpu_ops}}. gpu_busy_s is the union of
    the GPU's kernels and copies in it; gaps_s = wall_s - gpu_busy_s, the time the GPU waited on the host (launches, Python,
    syncs): a launch-bound step is mostly gaps. On a CPU the GPU lists are empty (everything is gaps)."""
    gpu = [_span(e) for e in _device_events(events, phases)]
    split = {}
    for name in phases:
        ranges = [_span(e) for e in events if e.name() == name and e.device_type() == torch.autograd.DeviceType.CPU]
        if not ranges:
            continue
        start, end = min(r[0] for r in ranges), max(r[1] for r in ranges)
        busy = covered_length(gpu, start, end)
        split[name] = {"wall_s": (end - start) / 1e9, "gpu_busy_s": busy / 1e9, "gaps_s": (end - start - busy) / 1e9,
                       "gpu_ops": sum(start <= b < end for b, _ in gpu)}
    return split


def _span(event):
    return event.start_ns(), event.start_ns() + event.duration_ns()


def _device_events(events, phases):  # the GPU's kernels and copies (not the annotations that mirror the phases there)
    return [e for e in events if e.device_type() != torch.autograd.DeviceType.CPU and not e.is_user_annotation()
            and e.name() not in phases]


def profiler_events(prof):
    """A finished torch.profiler run's raw events, read once: its per-op table takes minutes over a GPU step's few
    hundred thousand kernels, and each read of them builds as many Python objects."""
    return list(prof.profiler.kineto_results.events())


def top_device_ops(events, rows):
    """The `rows` kernel names with the most GPU time among a profile's raw events (the CPU's ops on a CPU, nested
    ones counted in each), as text."""
    chosen = _device_events(events, ()) or [e for e in events if not e.is_user_annotation()]
    seconds, calls = collections.Counter(), collections.Counter()
    for e in chosen:
        seconds[e.name()] += e.duration_ns() / 1e9
        calls[e.name()] += 1
    return "\n".join(f"{s:9.3f} s {calls[name]:8d} x  {name[:110]}" for name, s in seconds.most_common(rows))


def profile_phases(fn, device, phases, rows):
    """fn() once unprofiled (compiles, captures, caches), then again under torch.profiler, the device's kernels too:
    (profile_split of its phases, a line saying it, and the `rows` ops with the most device time)."""
    fn()
    cuda = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + cuda) as prof:
        fn()
    events = profiler_events(prof)
    split = profile_split(events, phases)
    line = "; ".join(f"{phase} {s['wall_s']:.2f}s = device busy {s['gpu_busy_s']:.2f}s ({s['gpu_ops']} kernels and "
                     f"copies) + gaps {s['gaps_s']:.2f}s" for phase, s in split.items())
    return split, line + "\n" + top_device_ops(events, rows)
