"""bench_rl --profile's split of a step (nanochat.runtime.machine.profile_split): per phase, the GPU's busy time (the union of
its kernels' and copies' intervals) against the gaps it waited on the host. The union against a brute-force count,
the split on profiler events built by hand (kernels, annotations mirrored on the GPU, phases), and on a real CPU
profile (the profiler's event API as this torch has it)."""

import random
from types import SimpleNamespace

import torch

from nanochat.runtime.machine import covered_length, profile_split, profiler_events, top_device_ops

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def test_covered_length_is_the_union_of_the_intervals_within_the_window():
    rng = random.Random(0)
    for _ in range(200):
        intervals = [(a, a + rng.randint(0, 15)) for a in (rng.randint(-10, 60) for _ in range(rng.randint(0, 8)))]
        start, end = sorted(rng.sample(range(-5, 70), 2))
        covered = sum(any(a <= t < b for a, b in intervals) for t in range(start, end))  # unit steps: exact here
        assert covered_length(intervals, start, end) == covered
    assert covered_length([(0, 5), (3, 8), (10, 12), (11, 11.5), (-3, 1)], 0, 11) == 9


def event(name, start, duration, device=CPU, annotation=False):
    return SimpleNamespace(name=lambda: name, start_ns=lambda: start, duration_ns=lambda: duration,
                           device_type=lambda: device, is_user_annotation=lambda: annotation)


def test_the_split_counts_kernels_inside_each_phase_once_and_not_the_annotations():
    events = [event("rollout", 0, 1000, annotation=True), event("training", 1000, 2000, annotation=True),
              event("rollout", 0, 1000, CUDA, annotation=True),  # the phase's range mirrored on the GPU
              event("sampling", 0, 800, CUDA, annotation=True),  # another record_function's, likewise
              event("mm", 100, 300, CUDA), event("add", 200, 300, CUDA),  # overlapping: 100..500 busy
              event("copy", 900, 200, CUDA),  # 900..1100: half in each phase
              event("mm", 1500, 500, CUDA), event("aten::mm", 1500, 400)]  # a CPU op: not the GPU's time
    split = profile_split(events, ("rollout", "training"))
    assert split["rollout"] == {"wall_s": 1e-6, "gpu_busy_s": 500e-9, "gaps_s": 500e-9, "gpu_ops": 3}
    assert split["training"] == {"wall_s": 2e-6, "gpu_busy_s": 600e-9, "gaps_s": 1400e-9, "gpu_ops": 1}
    assert top_device_ops(events, 2).splitlines()[0].split() == ["0.000", "s", "2", "x", "mm"]


def test_a_real_cpu_profile_splits_into_its_phases():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("rollout"):
            x = torch.randn(64, 64) @ torch.randn(64, 64)
        with torch.profiler.record_function("training"):
            x.sum()
    events = profiler_events(prof)
    split = profile_split(events, ("rollout", "training", "absent"))
    assert set(split) == {"rollout", "training"}
    for phase in split.values():  # no GPU: every second is a gap
        assert phase["wall_s"] > 0 and phase["gpu_busy_s"] == 0 and phase["gaps_s"] == phase["wall_s"]
    assert "aten::" in top_device_ops(events, 3)
