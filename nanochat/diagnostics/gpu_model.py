"""
A model of one decode step's GPU time, kernel by kernel, for the hand-written torch step and the Triton step, at
nanochat's d20 shapes: `python -m scripts.gpu_model` prints both steps' tables on an H200 and an H100,
the calibration against what was measured, and the Triton step before and after its attention was split.

Each kernel's work is recorded on the `meta` device (nanochat/diagnostics/gpu_kernel_work.py: bytes moved, FLOPs,
and for a Triton kernel its grid, threads, registers and dependent passes). Its time:

    kernel = KERNEL_SECONDS + max(bytes / copy bandwidth, FLOPs / matmul rate, waves x passes x PASS_SECONDS)

- copy bandwidth, matmul rate: what a device copy and a 2048² bf16 product reached on the card (bench_rl's probes),
  not the data sheet's: the fraction of the peak a streaming kernel reaches;
- waves: ceil(programs / (blocks an SM x SMs)), blocks an SM from the registers (ptxas) and threads of a program;
  a program's passes run one after another (a dependent load, then the math on it): the latency chain;
- KERNEL_SECONDS: what each kernel costs beyond its work under CUDA-graph replay (launch, ramp-up, tail).

A step = its kernels + HOST_GAP_SECONDS (the host's part of a step that the GPU waits for). The work is the bench's:
16 prompts x 16 samples, GSM8K-long prompts, 256-token rollouts; the step's time is averaged over a rollout (keys
1..256, at the midpoints of ROLLOUT_POINTS equal parts), as bench_rl's "decode ms/step" is (a rollout over its
forwards); `--keys=N` gives one step at N keys instead.
"""

import math
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from nanochat.diagnostics.gpu_kernel_work import RecordKernels, Workload, as_on_cuda
from nanochat.engine.decode_batch import DecodeBatch, RolloutStats
from nanochat.engine.decode_steps import decode_step_of
from nanochat.engine.decode_weights import DecodeWeights
from nanochat.engine.engine import prompt_slots
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.model.gpt import GPT, GPTConfig

D20 = dict(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280, window_pattern="SSSL")


@dataclass(frozen=True)
class Device:
    """A GPU: its SMs and their limits (sm_90), and the rates measured on one (docs/performance_history.md)."""
    name: str
    copy_bandwidth: float  # bytes/s a device copy reached
    matmul_rate: float     # bf16 FLOP/s a 2048² product reached
    peak_bandwidth: float  # the data sheet's HBM bytes/s (for the table only)
    sms: int = 132
    registers_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32


# H200: 3.9-4.1 TB/s by a device copy, 370-443 TFLOP/s bf16 (the third and fourth runs, 27-28 Nov 2026), of 4.8 TB/s
# and 989 TFLOP/s dense on the data sheet. H100 SXM: 2.9 TB/s, 330-430 TFLOP/s (the second run), of 3.35 TB/s.
H200 = Device("H200", 4.0e12, 400e12, 4.8e12)
H100 = Device("H100", 2.9e12, 380e12, 3.35e12)

# Calibrated on the H200's hand-written step (the fourth GPU run, 28 Nov 2026, bench_rl --preset=d20, graph decode):
# GPU busy 1.40 s of a 256 x 256 rollout under the profiler (~1,000 kernels a step) = 5.47 ms a decode step, the
# rollout 1.61 s without it = 6.29 ms a step. KERNEL_SECONDS is the fixed cost a kernel that fits the busy time
# (`fit_kernel_seconds` over the model's 1,115 kernels a step, printed by --calibrate: 2.89 us); HOST_GAP_SECONDS the
# rest, (1.61 - 1.40) s / 256.
KERNEL_SECONDS = 2.9e-6
HOST_GAP_SECONDS = (1.61 - 1.40) / 256
MEASURED_GPU_SECONDS = 1.40 / 256
MEASURED_STEP_SECONDS = {"H200": (6.28e-3, 6.40e-3), "H100": (10.9e-3, 10.9e-3)}
# The H100 step (second GPU run, 26 Nov 2026) and the first H200 one (8.2 ms) ran the step before commit 3cb885a,
# 1,634 kernels on the meta count against 1,149 after: 485 more kernels than today's step; and before the host ran
# one step behind (1646ab3, 27 Nov): the host's part was then all of it, 7.24 ms a step without the lag on the fourth
# run, less the GPU's 5.47 ms.
EARLIER_EXTRA_KERNELS = 1634 - 1149
EARLIER_H200_STEP_SECONDS = 8.2e-3
EARLIER_HOST_SECONDS = 7.24e-3 - MEASURED_GPU_SECONDS
# Not calibrated (no Triton kernel has yet run on a GPU; gpu_check's timing part decides): a dependent pass of a
# Triton program, a global load's round trip (~0.5-0.7 us on an H100/H200's HBM) plus the reductions and exp on it.
PASS_SECONDS = 0.8e-6
ROLLOUT_POINTS = 8


@dataclass(frozen=True)
class Constants:
    kernel_seconds: float = KERNEL_SECONDS
    pass_seconds: float = PASS_SECONDS
    host_gap_seconds: float = HOST_GAP_SECONDS


def blocks_per_sm(work, device):
    """Programs of a Triton kernel resident on one SM at once: registers (allocated 8 a thread at a time), threads and
    the SM's block limit."""
    registers = math.ceil(work.registers / 8) * 8 * work.threads
    return max(1, min(device.registers_per_sm // registers, device.threads_per_sm // work.threads,
                      device.blocks_per_sm))


def waves(work, device):
    return math.ceil(work.programs / (blocks_per_sm(work, device) * device.sms)) if work.programs else 1


def kernel_time(work, device, constants=Constants()):
    """(seconds of one launch, what bounds it: "memory", "math", "latency")."""
    terms = {"memory": work.bytes / device.copy_bandwidth, "math": work.flops / device.matmul_rate,
             "latency": waves(work, device) * work.passes * constants.pass_seconds}
    bound = max(terms, key=terms.get)
    return constants.kernel_seconds + terms[bound], bound


def record_step(decode_kernels, keys, workload=Workload(), config=D20, generation="jan2026", one_kernel_attention=False):
    """The KernelWork list of one static decode step (every row in use, `keys` completion keys each) of a model of
    `config` on `meta`, as the engine's bf16 graph decode runs it on CUDA (gpu_kernel_work's module docstring)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**config), generation)
    weights = DecodeWeights(model)
    if workload.dtype != torch.float32:
        weights.refresh(workload.dtype)
    slots = prompt_slots(workload.rows, workload.samples, workload.prompts)
    step = decode_step_of(decode_kernels)  # the engine's table: "torch" (hand-written) or "triton"
    cache = SharedPromptKVCache.for_model(model, workload.rows, slots, workload.prompt_cap, workload.new_tokens,
                                          rows_per_slot=workload.samples, dtype=workload.dtype, static=True,
                                          step_class=step.cache_step)
    batch = DecodeBatch(model, cache, 1.0, 50, RolloutStats(), weights=weights, step=step.static_step)
    recorder = RecordKernels(workload, one_kernel_attention)
    with as_on_cuda(), recorder, torch.no_grad():
        batch.run_step(workload.rows, keys)
    return recorder.kernels


def rollout_keys(workload, points=ROLLOUT_POINTS):
    """The completion keys of `points` steps spread over a rollout (the midpoints of equal parts of 1..new_tokens)."""
    return [max(1, round((i + 0.5) * workload.new_tokens / points)) for i in range(points)]


@dataclass
class KernelRow:
    """One kernel name's share of a step (its launches a step, bytes, FLOPs, seconds) and, at the last point of the
    rollout, its launch shape and what bounds it."""
    name: str
    launches: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0
    bound: str = ""
    last: object = None  # its KernelWork at the last point


@dataclass
class StepTime:
    rows: dict          # name -> KernelRow, averaged over the points
    kernels: float      # launches a step
    gpu_seconds: float
    host_seconds: float

    @property
    def seconds(self):
        return self.gpu_seconds + self.host_seconds


def step_time(steps, device, constants=Constants()):
    """The StepTime of recorded steps (a list of KernelWork lists, one a point of the rollout), averaged."""
    rows = defaultdict(lambda: KernelRow(""))
    for step in steps:
        for work in step:
            seconds, bound = kernel_time(work, device, constants)
            row = rows[work.name]
            row.name, row.bound, row.last = work.name, bound, work
            row.launches += 1 / len(steps)
            row.bytes += work.bytes / len(steps)
            row.flops += work.flops / len(steps)
            row.seconds += seconds / len(steps)
    return StepTime(dict(rows), sum(len(s) for s in steps) / len(steps), sum(r.seconds for r in rows.values()),
                    constants.host_gap_seconds)


def fit_kernel_seconds(steps, device=H200, gpu_seconds=MEASURED_GPU_SECONDS, constants=Constants()):
    """The fixed cost a kernel that makes the recorded steps' GPU time the measured one on `device`."""
    work_seconds = step_time(steps, device, replace(constants, kernel_seconds=0.0))
    return (gpu_seconds - work_seconds.gpu_seconds) / work_seconds.kernels


def calibration(hand_written, constants=Constants()):
    """What the model predicts for the measured figures (hand_written: its recorded steps over a rollout): rows of
    (what, predicted seconds, measured (low, high) seconds)."""
    # the earlier step: its kernels beyond today's, and the host's whole part instead of the lagging host's gap
    earlier = EARLIER_EXTRA_KERNELS * constants.kernel_seconds + EARLIER_HOST_SECONDS - constants.host_gap_seconds
    h200, h100 = (step_time(hand_written, device, constants).seconds for device in (H200, H100))
    return [("H200, hand-written step (28 Nov 2026)", h200, MEASURED_STEP_SECONDS["H200"]),
            ("H200, the step before 3cb885a and the lag", h200 + earlier, (EARLIER_H200_STEP_SECONDS,) * 2),
            ("H100, the step before 3cb885a and the lag", h100 + earlier, MEASURED_STEP_SECONDS["H100"])]


def relative_error(predicted, measured):
    """How far `predicted` is outside the measured range (low, high), relative to the nearer end (0 inside)."""
    low, high = measured
    return (predicted - high) / high if predicted > high else (predicted - low) / low if predicted < low else 0.0


def format_table(time, device, constants=Constants()):
    """The step's kernels, most time first: launches, MB, GFLOP and ms a step; a Triton kernel's programs, registers,
    blocks an SM, waves and passes (at the rollout's last point); what bounds it."""
    lines = [f"{'kernel':<28} {'n/step':>7} {'MB/step':>9} {'GFLOP':>7} {'ms/step':>8}  {'bound':<8} "
             f"{'programs':>8} {'regs':>5} {'blk/SM':>6} {'waves':>5} {'passes':>6}"]
    for row in sorted(time.rows.values(), key=lambda r: -r.seconds):
        w = row.last
        shape = (f"{w.programs:>8} {w.registers:>5} {blocks_per_sm(w, device):>6} {waves(w, device):>5} "
                 f"{w.passes:>6}") if w.programs else ""
        lines.append(f"{row.name:<28} {row.launches:>7.0f} {row.bytes / 1e6:>9.1f} {row.flops / 1e9:>7.1f} "
                     f"{row.seconds * 1e3:>8.3f}  {row.bound:<8} {shape}")
    bytes_ = sum(r.bytes for r in time.rows.values())
    lines.append(f"{'GPU':<28} {time.kernels:>7.0f} {bytes_ / 1e6:>9.1f} {'':>7} {time.gpu_seconds * 1e3:>8.3f}  "
                 f"(bytes at the data sheet's {device.peak_bandwidth / 1e12:.2f} TB/s: "
                 f"{bytes_ / device.peak_bandwidth * 1e3:.3f} ms)")
    lines.append(f"{'step (+ host gap)':<28} {'':>7} {'':>9} {'':>7} {time.seconds * 1e3:>8.3f}")
    return "\n".join(lines)


def print_model(keys=0, calibrate=False):
    """Print the model's tables (scripts/gpu_model.py): the hand-written step, the Triton step with its attention in one
    kernel and split, on an H200 and an H100, at `keys` completion keys (0: a rollout's mean); the calibration against
    what was measured; with `calibrate`, the kernel cost that fits the H200's figure."""
    workload = Workload()
    points = [keys] if keys else rollout_keys(workload)
    hand = [record_step("torch", k, workload) for k in points]
    steps = {"hand-written": hand, "Triton, attention in one kernel (before)":
             [record_step("triton", k, workload, one_kernel_attention=True) for k in points],
             "Triton, attention split (now)": [record_step("triton", k, workload) for k in points]}
    if calibrate:
        print(f"KERNEL_SECONDS that fits the H200's {MEASURED_GPU_SECONDS * 1e3:.2f} ms of GPU busy a step: "
              f"{fit_kernel_seconds(hand) * 1e6:.2f} us")
    for what, predicted, measured in calibration(hand):
        print(f"{what}: predicted {predicted * 1e3:.2f} ms, measured {measured[0] * 1e3:.2f}-{measured[1] * 1e3:.2f}"
              f" ms ({relative_error(predicted, measured):+.0%})")
    for seconds in (0.5e-6, PASS_SECONDS, 1.2e-6):  # the one constant no GPU figure has calibrated yet
        constants = Constants(pass_seconds=seconds)
        print(f"at {seconds * 1e6:.1f} us a pass, H200 GPU ms a step: " + ", ".join(
            f"{name} {step_time(recorded, H200, constants).gpu_seconds * 1e3:.2f}" for name, recorded in steps.items()))
    for device in (H200, H100):
        for name, recorded in steps.items():
            print(f"\n{name} step on an {device.name}, {'a rollout mean' if not keys else f'{keys} keys'}:")
            print(format_table(step_time(recorded, device), device))
