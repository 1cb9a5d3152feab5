"""
Process-level plumbing shared by every script: device and process-group setup, rank info,
rank-0 printing, the base directory, a no-op wandb, and the errors a user can fix (UserError).
The command-line side of those errors (flags, one-line printing) is nanochat.cli.

`compute_init()` / `compute_cleanup()` own the device, the seeds, the matmul precision and the
process group. Everything else asks `torch.distributed.is_initialized()`; nothing keeps a second flag.
"""

import contextlib
import gc
import os
import platform
import re
import signal
import sys

import torch
import torch.distributed as dist


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file, ...). Scripts print it as one line, no traceback."""


def require(ok, message):
    """Raise UserError(message) unless ok: the validators' one check (not `assert`, which `python -O` drops)."""
    if not ok:
        raise UserError(message)


class SettingError(UserError):
    """A bad value of the setting `setting` (a function argument that the scripts take from the flag of the
    same name: device_type from --device-type). The message reads "<setting> <problem>"; nanochat.cli
    names the flag instead."""

    def __init__(self, setting, problem):
        super().__init__(f"{setting} {problem}")
        self.setting, self.problem = setting, problem


def rank_and_world():
    """(rank, world_size) of this process: the process group's once it is up, else what torchrun set in
    RANK and WORLD_SIZE (before compute_init, e.g. for a validation error), else (0, 1). The environment
    counts only when it is a whole torchrun launch (is_ddp_launch), the rule compute_init follows: a launcher
    that sets RANK without LOCAL_RANK runs one process, which must then save, evaluate and step as rank 0.
    The one place the library learns its rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if is_ddp_launch():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def get_rank():
    return rank_and_world()[0]


def print0(*args, **kwargs):
    """print() on rank 0 only."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def get_base_dir():
    """Where tokenizer, data, checkpoints and reports live: $NANOCHAT_BASE_DIR or ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    return base


def is_ddp_launch():
    """True when launched by torchrun (which sets RANK, LOCAL_RANK and WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def get_dist_info():
    """(is_ddp, rank, local_rank, world_size) of a torchrun launch; (False, 0, 0, 1) otherwise."""
    if is_ddp_launch():
        rank, world_size = rank_and_world()
        return True, rank, int(os.environ["LOCAL_RANK"]), world_size
    return False, 0, 0, 1


def rank_share(start, stop, rank, world_size):
    """This rank's share of the items start..stop-1: every world_size-th one from start + rank, so the ranks
    together cover each item once (the split of RL questions, eval questions and SFT examples)."""
    return range(start + rank, stop, world_size)


def autodetect_device_type():
    """cuda > mps > cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def compute_init(device_type="", seed=42):
    """Pick the device, seed the global RNGs, set matmul precision, and (under torchrun) create the
    process group: NCCL on CUDA, gloo on CPU. Returns (is_ddp, rank, local_rank, world_size, device)."""
    device_type = device_type or autodetect_device_type()
    if device_type not in ("cuda", "cpu", "mps"):
        raise SettingError("device_type", f"{device_type!r} is unknown; use cuda, cpu or mps (or leave it empty to autodetect)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SettingError("device_type", "is cuda but torch sees no CUDA device; use cpu or install a CUDA build of torch")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise SettingError("device_type", "is mps but MPS is not available on this machine; use cpu")

    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
        torch.backends.cuda.matmul.allow_tf32 = True  # tf32 for the fp32 matmuls that remain
        torch.backends.cudnn.allow_tf32 = True

    is_ddp, rank, local_rank, world_size = get_dist_info()
    if is_ddp and device_type == "mps" and world_size > 1:
        raise SettingError("device_type", "is mps, which cannot run several ranks (no NCCL/gloo device backend); "
                                          "run one process, or use cpu")
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if is_ddp and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            dist.init_process_group(backend=backend, device_id=device)
        else:
            dist.init_process_group(backend=backend)
        dist.barrier()
    return is_ddp, rank, local_rank, world_size, device


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


def synchronize(device):
    """Wait for the device's queued work (CUDA, MPS), so that a wall-clock time measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def to_device(tensor, device):
    """`tensor`, a host tensor, on `device` without waiting for it. A plain CPU -> CUDA copy synchronizes the stream
    (PyTorch waits for the copy, so the host waits for every kernel queued before it): in the training pass that
    stopped the host from queuing the next chunk while the GPU ran this one, once per small index tensor. Copied
    from pinned memory the transfer is queued like a kernel (PyTorch's host allocator keeps the pinned block until
    the copy is done). Elsewhere (CPU, MPS) a plain .to(device)."""
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def autocast_context(device, dtype):
    """bf16 or fp16 autocast on `device`, or nothing for float32 (weights are float32 either way)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.amp.autocast(device_type=device.type, dtype=dtype)


def is_out_of_memory(error):
    """Whether `error` is running out of device memory: the allocator's torch.OutOfMemoryError, or the CUDA runtime's
    (an AcceleratorError), raised outside the allocator, e.g. making a stream (an H200's warm-up stream)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "CUDA error: out of memory" in str(error))


def out_of_memory_within(error):
    """The out-of-memory error (is_out_of_memory) that `error` is or wraps (torch.compile's BackendCompilerFailed
    keeps it in inner_exception or __context__), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if is_out_of_memory(error):
            return error
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def release_cached_memory(runtime_error):
    """After an out-of-memory of the CUDA runtime (runtime_error; not the allocator's, which gave back its cached
    blocks before raising), once the failed attempt's tensors are gone, give the cached blocks back to the driver,
    which a stream or a library workspace is made from, so that a retry with less finds the room."""
    if runtime_error and torch.cuda.is_initialized():
        gc.collect()  # a failed frame caught in a reference cycle, with the tensors it held
        torch.cuda.empty_cache()


def wait_for_all_ranks():
    """At the end of a run that ended well, before compute_cleanup: no rank tears the process group down while
    another (rank 0 writing its report or checkpoint) is still at work. A rank that left first was aborted by gloo
    at exit ("terminate called without an active exception": chat_eval's 2-rank test, 2 of 16 runs; 0 of 20 with
    the barrier). Not on an error path: a rank that failed alone would wait there for ever."""
    if dist.is_initialized():
        dist.barrier()


def compute_cleanup():
    """Tear down the process group, if any."""
    if dist.is_initialized():
        release_process_group()


def cleanup_after_error():
    """Tear down a gloo process group, if any, on an error path: without wait_for_all_ranks' barrier (a rank that
    failed alone would wait there for ever). A process that exited with its group alive left gloo's threads to the
    interpreter's exit, which now and then aborted it ("terminate called without an active exception", exit code
    -6 instead of the error's 2; a 2-rank --resume refused on both ranks, once in a loaded test run). Not NCCL's:
    its teardown can wait for a collective that a rank which failed alone will never join."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            release_process_group()
        except Exception:  # already broken (a peer gone): the exit code must still be the error's
            pass


def release_process_group():
    """destroy_process_group, after a collection: gloo's work objects caught in reference cycles (a distributed
    optimizer's) still hold tensors, and freed during the interpreter's exit they take the GIL from a dying
    interpreter, which aborts the process ("terminate called without an active exception"; pytorch#179291)."""
    gc.collect()
    dist.destroy_process_group()


def collective_device(device):
    """Where a tensor that ranks reduce together must live: the rank's CUDA device (NCCL reduces CUDA tensors
    only), else the CPU (gloo)."""
    device = torch.device(device)
    return device if device.type == "cuda" else torch.device("cpu")


def reduction_dtype(device):
    """The dtype of sums reduced across ranks: float64 on the CPU, float32 on a GPU. Decided by the device's
    type, so torch.device("cpu") and "cpu" get the same precision."""
    return torch.float64 if torch.device(device).type == "cpu" else torch.float32


def any_rank(flag, device="cpu"):
    """Whether `flag` (a bool) holds on any rank (itself without a process group): every rank must call it at the
    same point. `device`: see collective_device."""
    value = torch.tensor([int(flag)], device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_reduce_mean(x, device="cpu"):
    """Average a python float or tensor over ranks (identity without a process group).
    `device`: see collective_device."""
    t = torch.as_tensor(x, dtype=reduction_dtype(device), device=device).clone()
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t.item() if t.numel() == 1 else t


def grad_norm(model):
    """L2 norm of this rank's gradients (before the distributed optimizers average them); inf/nan if any is."""
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item() if norms else 0.0


class _NoProgress:
    def update(self, n=1):
        pass

    def close(self):
        pass


def progress_bar(total, desc):
    """A tqdm bar on rank 0 when stderr is a terminal; a no-op otherwise (CI and log files get the plain
    per-step lines instead of carriage-return noise)."""
    if get_rank() != 0 or not sys.stderr.isatty():
        return _NoProgress()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def format_duration(seconds):
    """12.3 -> '12s', 754 -> '12m34s', 7500 -> '2h05m'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def remaining_seconds(step_seconds, steps_left, eval_seconds=(), evals_left=0):
    """Time left in a run, as (training, eval) seconds: steps_left steps at the mean of step_seconds (each
    step's rollout + training + optimizer time, evals excluded), and evals_left evals at the mean of
    eval_seconds (0 until an eval has been timed). An eval takes far longer than a step, so counting it as
    step time would inflate the estimate many times over at the start of a run."""
    train = steps_left * sum(step_seconds) / len(step_seconds) if step_seconds else 0.0
    evals = evals_left * sum(eval_seconds) / len(eval_seconds) if eval_seconds else 0.0
    return train, evals


class DummyWandb:
    """Stand-in for a wandb run when logging is off (`--run=dummy`): every call is a no-op."""

    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


class GracefulStop:
    """SIGINT/SIGTERM handling for long runs: the first signal asks the loop to stop at the next step
    boundary (it then saves and exits); a second signal exits at once."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"received {signal.Signals(signum).name} again: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print0(f"received {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
               f"(send it again to exit at once)")

    def requested(self, device="cpu"):
        """True if any rank received a signal (all ranks must agree, or their collectives would hang)."""
        return any_rank(self.signum is not None, device)
