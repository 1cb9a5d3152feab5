"""
How an engine runs its rollouts, resolved once: RolloutSpec, what an Engine is built from (its decode mode, whether
its static step is compiled, the dtype it decodes in, the KV caches' memory budget, the rows it decodes at once at
most, the decode step it runs (decode_steps.py's table), the calculator's format, a prefill's positions, the host's
lag behind the device), and resolve_rollout_spec, the one function that resolves it from a script's settings
(rollout_spec: for a model, on its device; an Engine is built from the spec, engine.Engine(model, tokenizer, spec)). A
chat_rl run's plan holds its spec (nanochat/rl/plan.py's RunPlan) and prints it (RolloutSpec.describe); where
--compile=auto switches the decode step during the run, a new spec takes its place (RolloutSpec.with_step_compiled)
and the engine runs it from the next rollout on (Engine.reconfigure).

The memory budget: how much memory the rollout batches' KV caches in memory at once may take together
(`--memory-budget-gb`; a step's and an eval's, see engine.Engine._new_batch), decided once at the start of a run.

    --memory-budget-gb=N     N GiB, on every device
    --memory-budget-gb=auto  (the default) on CUDA: FRACTION of what is left of the device's free memory, measured
                             with the model (and a --kl-coef reference) loaded, once the run's later allocations
                             are set aside:
                                 budget = FRACTION * (free - optimizer - decode weights - training peak)
                             elsewhere: FIXED_GB (CPU and MPS memory is shared with everything else on the machine,
                             and a CPU run is not limited by it)

What is set aside is what the run allocates after the budget is decided, at full size (an upper bound): training's
optimizer state and gradients and its pass's activations (its training peak), which training counts and hands in
(nanochat/optim/training_memory.py), and the decode weights, the bf16 copies of the matmul weights that bf16 rollouts
use (engine.DecodeWeights; 2 bytes per weight, outside the KV budget; for fp32 rollouts the q/k/v concatenations, 4
bytes a weight). The KV caches of static decode batches are kept from one rollout to the next (the step's and the
eval's, within the budget together), so they are still there when the model trains: hence the training peak in the
reserve. FRACTION leaves room for the allocator's fragmentation and for what the estimates miss (CUDA-graph pools, one
per kept batch; temporaries of the optimizer step). An out-of-memory in training gives back the eval's batch first
(the engine's RolloutMemory.yield_memory).

The arithmetic is `plan_budget`, a pure function of byte counts; `resolve_memory_budget` measures the free memory and
returns the GiB the spec takes, with the line that states how it was chosen.
"""

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from nanochat.compiling.plan import COMPILE_MODES, compile_plan
from nanochat.engine.calculator import CALCULATOR_FORMATS, DEFAULT_FORMAT
from nanochat.engine.cuda_graphs import DECODE_DESCRIPTIONS, decode_mode
from nanochat.engine.decode_weights import fusable_attention, qkv_weights
from nanochat.engine.decode_steps import AUTO, decode_step_of, resolve_decode_kernels
from nanochat.engine.scheduler import PREFILL_TOKENS
from nanochat.errors import SettingError, UserError
from nanochat.runtime.dtypes import DTYPES, autocast_context

FIXED_GB = 4.0  # off CUDA, and the budget nanochat-rl had everywhere before "auto"
FRACTION = 0.9
GiB = 1 << 30
ROLLOUT_DTYPES = (None,) + tuple(name for name in DTYPES if name != AUTO)  # None: the caller's autocast


def check_calculator_format(style):
    if style not in CALCULATOR_FORMATS:
        raise ValueError(f"calculator_format must be one of {', '.join(CALCULATOR_FORMATS)}, got {style!r}")
    return style


@dataclass(frozen=True)
class RolloutSpec:
    """What an Engine is built from, each value resolved (resolve_rollout_spec), checked where it is made."""
    decode: str = "eager"              # the decode mode that runs: eager, static or graph (cuda_graphs.decode_mode)
    compiled: bool = False             # the static decode step runs compiled (static and graph modes run it)
    compile_required: bool = False     # a failure to compile it is an error (--compile=on), else a warning and eager
    memory_budget_gb: float = FIXED_GB  # the KV caches' budget, the batches kept between rollouts included
    max_rows: Optional[int] = None     # rows decoded at once at most; None: what the budget holds
    share_prompts: bool = True         # a prompt's keys and values stored once for all its rows
    decode_kernels: str = "torch"      # the decode step it runs: torch, flex or triton (decode_steps.py; auto resolved)
    calculator_format: str = DEFAULT_FORMAT  # how a tool result is written (calculator.format_result)
    prefill_tokens: int = PREFILL_TOKENS  # positions one prefill forward takes at most (1: one prompt at a time)
    lag: bool = False                  # the host one step behind the device (DecodeBatch.decode_step)
    dtype: Optional[str] = None        # what it decodes in (float32, bfloat16, float16: the engine's own autocast,
    #                                    see autocast); None: its caller's autocast, as nanochat's Engine

    def __post_init__(self):
        check_calculator_format(self.calculator_format)
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"a rollout dtype must be one of {', '.join(map(str, ROLLOUT_DTYPES))}, got {self.dtype!r}")
        decode_step_of(self.decode_kernels).check(self.share_prompts, self.compiled)

    def autocast(self, device):
        """The autocast an engine of this spec decodes under on `device`: its dtype's (float32: autocast off, whatever
        its caller's), or where it names none, its caller's (nanochat's Engine decodes under the script's autocast)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        if self.dtype == "float32":  # autocast_context's float32 is none at all: a caller's would go on
            return torch.autocast(device.type, enabled=False)
        return autocast_context(device, getattr(torch, self.dtype))

    def describe(self):
        """The line a run prints about its rollouts' decode step."""
        how = DECODE_DESCRIPTIONS[self.decode]
        how = "bucketed static shapes, compiled" if self.compiled and self.decode == "static" else how
        return (f"rollouts: {self.decode} decode step ({how}; --decode to choose), in {self.decode_kernels} kernels "
                f"(--decode-kernels to choose)")

    def with_step_compiled(self, on, decode, device):
        """This spec with its static step compiled (on) or not, as --compile=auto switches it during a run on `device`
        whose --decode is `decode` (the mode rollout_decode_mode gives for it)."""
        return dataclasses.replace(self, compiled=on, decode=rollout_decode_mode(decode, device, on))


def rollout_decode_mode(decode, device, compiled):
    """The decode mode that runs for --decode=`decode` on `device`, its static step compiled or not: decode_mode's
    (auto: graph on CUDA, eager elsewhere), except that auto on a CPU decodes with the static step where that step is
    compiled (compiled, the static step is the faster one there; uncompiled, the exact-shape eager step is)."""
    mode = decode_mode(decode, device)
    return "static" if compiled and decode == "auto" and mode == "eager" else mode


def resolve_rollout_spec(device, decode="auto", compile="off", lag=None, decode_kernels=AUTO, **fields):
    """The RolloutSpec of an engine on `device`, for a script's settings and a chat_rl run alike. decode: as
    --decode takes it (an unusable mode is a ValueError here, before anything is built). compile: a --compile mode
    (compile_plan's rule for the static step in that decode mode; a failure to compile it is an error under on, else
    a warning and the eager step), or whether a run compiles its static step (its CompilePlan's decode part, or
    --compile=auto's switch; a failure warns): auto then decodes with that step (rollout_decode_mode). decode_kernels:
    the decode step (decode_steps.py; auto resolved here, once), refused where it cannot run on `device`; a step that
    never compiles (triton) is not compiled under auto, and refused where asked to be (True or on). lag: None is on
    CUDA (a CPU is its own device: nothing to overlap). fields: RolloutSpec's others, as given."""
    if not isinstance(compile, bool) and compile not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
    decode_kernels = resolve_decode_kernels(decode_kernels, device)
    decode_step_of(decode_kernels).check_device(device)
    if not decode_step_of(decode_kernels).compiles:
        compiled = compile is True or compile == "on"  # refused by the spec
    elif isinstance(compile, bool):
        compiled = compile
    else:
        compiled = bool(compile_plan(compile, device, decode_mode(decode, device)).decode)
    return RolloutSpec(decode=rollout_decode_mode(decode, device, compiled), compiled=compiled,
                       compile_required=compile == "on", lag=device.type == "cuda" if lag is None else lag,
                       decode_kernels=decode_kernels, **fields)


def rollout_spec(model, **settings):
    """The RolloutSpec of an engine of `model` on its device: resolve_rollout_spec's for these settings (decode,
    compile, lag, decode_kernels, and RolloutSpec's other fields), e.g. Engine(model, tokenizer,
    rollout_spec(model, decode="static", max_rows=8))."""
    return resolve_rollout_spec(model.get_device(), **settings)


def run_decode_mode(decode_flag, compile_mode, device, num_steps, dtype="bfloat16", measured=False):
    """The decode mode a chat_rl run of num_steps steps asks compile_plan about for --decode=`decode_flag`:
    rollout_decode_mode's, with the static step compiled where --compile=`compile_mode` compiles it for such a run
    (compile_plan: auto from CPU_DECODE_MIN_STEPS steps, on always) on a CPU and the run trains in bf16 (`dtype`, its
    rollouts then too): compiled in bf16, the static step is the faster one there, uncompiled the exact-shape eager
    step is; in fp32 the compiled step's gain is too small to pay for its compile (docs/performance.md). measured: see
    compile_plan (the run starts with the uncompiled mode)."""
    compiles = (device.type == "cpu" and dtype == "bfloat16"
                and compile_plan(compile_mode, device, "static", num_steps, measured=measured).decode)
    return rollout_decode_mode(decode_flag, device, bool(compiles))


def parse_budget(text):
    """--memory-budget-gb's value: AUTO, or a number of GiB > 0 (else a SettingError, shown under the flag)."""
    if text == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0:  # not a number, or <= 0, or nan
        raise SettingError("memory_budget_gb", f"must be auto or a number of GiB > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class MemoryPlan:
    """An auto budget and what it was computed from, in bytes (see the module docstring)."""
    free: int            # the device's free memory, measured with the model loaded
    model: int           # the model's parameters (already out of `free`; stated, not subtracted)
    optimizer: int       # gradients and optimizer state still to be allocated
    decode_weights: int  # bf16 copies of the matmul weights for rollouts
    training_peak: int   # activations of one training forward and backward
    fraction: float = FRACTION

    @property
    def reserved(self):
        return self.optimizer + self.decode_weights + self.training_peak

    @property
    def budget_bytes(self):
        return int(self.fraction * (self.free - self.reserved))

    @property
    def budget_gb(self):
        return self.budget_bytes / GiB

    def describe(self):
        gb = lambda n: f"{n / GiB:.1f} GiB"
        return (f"KV cache budget (--memory-budget-gb=auto): {gb(self.budget_bytes)} = {self.fraction:g} x ({gb(self.free)} "
                f"free with the model's {gb(self.model)} loaded - {gb(self.reserved)} reserved: optimizer state and "
                f"gradients {gb(self.optimizer)}, bf16 decode weights {gb(self.decode_weights)}, training peak "
                f"{gb(self.training_peak)} (estimated))")


class NoMemoryForRolloutsError(UserError):
    """Nothing of the device's free memory is left for a KV cache once the rest of the run is counted. The
    message states the arithmetic; what to change on the command line is the script's (nanochat/cli.py's HINTS)."""


def plan_budget(free, model, optimizer, decode_weights, training_peak, fraction=FRACTION):
    """The MemoryPlan of these byte counts; a NoMemoryForRolloutsError when nothing is left for a KV cache."""
    plan = MemoryPlan(int(free), int(model), int(optimizer), int(decode_weights), int(training_peak), fraction=fraction)
    if plan.budget_bytes <= 0:
        raise NoMemoryForRolloutsError(f"no device memory left for rollouts: {plan.describe().split(': ', 1)[1]}")
    return plan


def decode_weight_bytes(model, rollout_dtype):
    """What the engine's DecodeWeights hold: the bf16/fp16 copies of the matmul weights (every nn.Linear) that
    low-precision rollouts use (the q/k/v concatenations among them); in fp32, the q/k/v concatenations alone."""
    if rollout_dtype not in (torch.bfloat16, torch.float16):
        return sum(w.numel() * w.element_size() for m in fusable_attention(model) for w in qkv_weights(m))
    size = torch.tensor([], dtype=rollout_dtype).element_size()
    return sum(m.weight.numel() * size for m in model.modules() if isinstance(m, torch.nn.Linear))


def resolve_memory_budget(value, model, device, rollout_dtype=torch.bfloat16, optimizer=0, training_peak=0):
    """The GiB of KV cache a spec takes for `value` (parse_budget's), and the line that says how an auto budget was
    chosen (None for a number given). On CUDA `auto` measures the free memory now, so call it once the model and any
    reference model exist, before the Engine; training reserves `optimizer` bytes of gradients and optimizer state
    still to be allocated and `training_peak` bytes of its pass's activations (0 for a run that does not train;
    nanochat/optim/training_memory.py counts both). Elsewhere it is FIXED_GB."""
    if value != AUTO:
        return float(value), None
    if device.type != "cuda":
        return FIXED_GB, f"KV cache budget (--memory-budget-gb=auto): {FIXED_GB:g} GiB, the fixed default on {device.type}"
    torch.cuda.empty_cache()  # blocks cached while loading (the bf16 -> fp32 copies) are free for the cache
    free, _ = torch.cuda.mem_get_info(device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = plan_budget(free, model_bytes, optimizer, decode_weight_bytes(model, rollout_dtype), training_peak)
    return plan.budget_gb, plan.describe()
