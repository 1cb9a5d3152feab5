"""
torch.compile for a run's two hot paths, and what compiling them costs.

- The static decode step (nanochat/engine/decode_batch.py's `static_step`): fullgraph, dynamic shapes, so one
  graph (a step runs 2 rows at least: nanochat/engine/cuda_graphs.py's ROW_BUCKETS; Inductor may add a copy guarded
  on all of the batch's rows, from its cache) serves every bucketed (rows, keys) shape, where one graph per shape
  would compile each of a static batch's 100+ shapes on its own. On CUDA the engine's own graphs
  (nanochat/engine/cuda_graphs.py's GraphedStep) capture the compiled step: it is compiled in Inductor's default mode,
  without Inductor's cudagraphs, so that one owner captures and replays (the engine's graphs already hold every bucket
  in one pool, warmed up on a side stream; "reduce-overhead" would capture a second time inside them).
- The training pass's forward (nanochat/rl/policy_gradient.py's `chunk_logprobs`: hidden states, logits at the sampled
  positions, log-probabilities and entropy), for the policy-gradient pass, the PPO epochs and the reference
  model alike: dynamic shapes (rows, lengths, prompt lengths vary from chunk to chunk), so a run compiles it a
  bounded number of times (a few graphs: with or without a shared prompt, grad on or off), not once per length.
  SFT's (nanochat/sft.py's `summed_cross_entropy`: a micro-batch's forward and summed loss) likewise.

Which of them a script compiles is its CompilePlan (compile_plan: what --compile=auto|on|off means on each device;
chat_rl and bench_rl have both, chat_sft the training forward and the decode step of its stop checks, chat_eval
the decode step). chat_rl's --decode=auto on a CPU is the static step where the plan compiles it (run_decode_mode).

A compiled function counts its compiles (graphs handed to Inductor) and the seconds of the calls that compiled
(tracing, Inductor and its C++ or Triton compile, and the call itself: the first-call cost a run pays). Both
are shared by every caller in the process, as Dynamo's cache is (it is kept per function): a second engine
or model of the same shapes reuses the graphs. Inductor also keeps its compiled kernels on disk
(TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER), so a second run compiles much faster.

Where compiling fails (no C++ compiler on a CPU, an operation Dynamo or Inductor cannot take), the function
says so in one warning line and runs eagerly from then on; with required=True (--compile=on) the failure is a
UserError instead. Errors of the computation itself (an out-of-memory included) are never caught.
"""

import functools
import os
import sysconfig
import time
import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from nanochat.common import UserError, collective_device, out_of_memory_within, print0
from nanochat.model.gpt import EAGER_REGIONS, BlockRegions
from nanochat.model.inductor_code import GraphKernels, inductor_code_to

COMPILE_MODES = ("auto", "on", "off", "blocks")
RECOMPILE_LIMIT = 256  # graphs per compiled function: every decode bucket of a large batch (Dynamo's default is 8)
# The autocast regions our graphs hold (fp32 attention scores under bf16 autocast: attention.fp32_scores) marked as
# cacheable: AOTAutograd's cache refuses a graph calling a function it does not know, these included, and then a run
# whose graphs are all in Inductor's cache traces forward and backward anew (the speedrun's training forward: 13.5 s
# warm against 49.6 s cold). Entering and leaving autocast computes nothing; their arguments are in the graph's key.
AUTOCAST_REGIONS = {f"torch.amp.autocast_mode.{name}": torch.__version__ for name in ("_enter_autocast", "_exit_autocast")}


def compile_errors():
    """The exception types that mean "this could not be compiled" (not "the computation failed")."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import InductorError
    return (TorchDynamoException, InductorError)


class CompileFailed(UserError):
    """--compile=on and compiling failed."""


class CompiledFunction:
    """`fn` compiled (fullgraph), run through Inductor; falls back to `fn` where that fails (the module docstring).
    compiles: graphs compiled so far; kernels: what one call of each of them launches (GraphKernels, read from the
    code Inductor wrote: None where none was seen); seconds: wall time of the calls that compiled; failed: why it
    runs eagerly (None while compiled).
    announce: print a line (rank 0) as each graph goes to Inductor and as it comes back compiled.
    graph_compiler: what turns each traced graph into code, Inductor's compile_fx unless given (the tests pass one
    that runs Dynamo's graph as traced, where Inductor's minute of code generation is not what they check)."""

    def __init__(self, fn, dynamic, announce=True, graph_compiler=None):
        self.fn, self.name, self.announce = fn, fn.__name__, announce
        self.compiles, self.kernels, self.seconds, self.failed = 0, [], 0.0, None
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic,
                                      backend=_CountingInductor(self, graph_compiler))

    def __call__(self, *args, required=False):
        if self.failed is not None:
            if required:
                raise CompileFailed(f"torch.compile cannot compile {self.name}: {self.failed}")
            return self.fn(*args)
        before, t0 = self.compiles, time.perf_counter()
        try:
            # specialize_float: the floats our functions read (softcaps, scales) are constants of the run; traced as
            # symbols, Inductor's pass that turns them into tensors gave up and had Dynamo trace the whole graph again
            # (TensorifyScalarRestartAnalysis: the speedrun's training forward traced twice, ~20 s of its compile)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, specialize_float=True,
                                            accumulated_recompile_limit=4 * RECOMPILE_LIMIT), \
                    torch._inductor.config.patch(unsafe_marked_cacheable_functions=AUTOCAST_REGIONS):
                out = self.compiled(*args)
        except compile_errors() as error:
            out_of_memory = out_of_memory_within(error)
            if out_of_memory is error:
                raise
            if out_of_memory is not None:  # not a failure to compile: the caller backs off with fewer rows
                raise out_of_memory from error
            self.failed = first_line(error)
            if required:
                raise CompileFailed(f"torch.compile cannot compile {self.name}: {self.failed}") from error
            warnings.warn(f"torch.compile failed on {self.name} ({self.failed}); it runs eagerly from now on",
                          stacklevel=2)
            return self.fn(*args)
        if self.compiles != before:
            self.seconds += time.perf_counter() - t0
        return out


class _CountingInductor:
    """A torch.compile backend: Inductor (default mode: no cudagraphs of its own), counting the graphs it gets."""

    def __init__(self, owner, graph_compiler=None):
        self.owner, self.graph_compiler = owner, graph_compiler
        self.announced = 0  # the graph number last said to go to Inductor

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        number, t0 = self.owner.compiles + 1, time.perf_counter()
        # said before and after: a compile may take minutes (a large model's decode step on a GPU does), and a run
        # that goes quiet for that long must say why
        if self.owner.announce:
            again = " again (Dynamo traced it anew)" if self.announced == number else ""
            why = recompile_reason() if number > 1 and not again else None
            print0(f"compile: {self.owner.name}: graph {number} going to Inductor{again}"
                   + (f" (no earlier graph fits: {why})" if why else ""))
        self.announced = number
        with inductor_code_to(codes := []):  # a graph from Inductor's disk cache hands over its code too
            compiled = (self.graph_compiler or compile_fx)(graph_module, example_inputs)
        # counted once compiled: Dynamo may call the backend again for the same graph after Inductor asked it to
        # trace again (TensorifyScalarRestartAnalysis, seen on the decode step), and the call that raised made none
        self.owner.compiles += 1
        kernels = GraphKernels.of(codes)
        self.owner.kernels.append(kernels)
        if self.owner.announce:
            print0(f"compile: {self.owner.name}: graph {number} compiled in {time.perf_counter() - t0:.1f} s"
                   + (f" ({kernels})" if kernels else ""))
        return compiled


def recompile_reason():
    """Why Dynamo is compiling a function it has compiled before: the first guard of an earlier graph that failed,
    as Dynamo words it (e.g. "2 <= rows"), or None where this torch does not say. Read from Dynamo's record of
    the compile in progress (a private one: other torch versions may keep it elsewhere, and then no reason is
    given), so that a recompile in the middle of a run, which can take a minute on a CPU, says what caused it."""
    try:
        from torch._dynamo.utils import get_metrics_context
        reason = get_metrics_context()._metrics.get("recompile_reason")
    except Exception:  # any change in torch's private record: no reason, never a failed compile
        return None
    if not isinstance(reason, str) or not reason.strip() or reason.startswith("Unable to find"):  # Dynamo's "none"
        return None
    return " ".join(reason.split())


def first_line(error):
    """What failed, in one line: the message's first line (the backend's own error, not Dynamo's wrapper of it)
    with its type, and where Dynamo explains it, its explanation and the innermost frame of our code that it was
    tracing ("Unsupported method call" alone, the first CUDA run's whole report, names neither the method nor the
    line). The wrapper's message is searched too: the backend's own has no frames."""
    inner = getattr(error, "inner_exception", None) or error
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    every = lines + ([line.strip() for line in str(error).splitlines() if line.strip()] if inner is not error else [])
    said = f"{type(inner).__name__}: {lines[0] if lines else ''}".strip()
    explanation = next((line.split(":", 1)[1].strip() for line in every if line.startswith("Explanation:")), None)
    frames = [line for line in every if line.startswith('File "') and _is_ours(line[len('File "'):].partition('"')[0])]
    where = None
    if frames:  # File "/path/to/x.py", line 12, in fn
        path, _, rest = frames[-1][len('File "'):].partition('"')
        where = f"{os.path.basename(path)}{rest.replace(', line ', ':').replace(', in ', ' in ')}"
    detail = "; ".join(part for part in (explanation, where and f"at {where}") if part)
    return f"{said} ({detail})" if detail else said


def _is_ours(path):
    """Whether a traceback's file is code of this program, not torch's, an installed package's or Python's own."""
    path = os.path.abspath(path)
    if "site-packages" in path or "dist-packages" in path:  # installed packages, this interpreter's or another's
        return False
    # torch and Python itself, wherever they are installed (a source build of torch is in no site-packages)
    return not any(path.startswith(os.path.abspath(root) + os.sep)
                   for root in (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]))


_COMPILED = {}  # (fn, dynamic) -> its CompiledFunction: one per process, as Dynamo's cache is one per function


def compiled(fn, dynamic, announce=True):
    """The process's CompiledFunction of `fn` (made at the first request; announce: see CompiledFunction)."""
    key = (fn, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = CompiledFunction(fn, dynamic, announce)
    return _COMPILED[key]


def compiled_so_far(fn, dynamic):
    """The process's CompiledFunction of `fn` if one was made, else None (asking makes none)."""
    return _COMPILED.get((fn, dynamic))


def maybe_compiled(fn, on, dynamic, required=False):
    """`fn` itself (on=False), or its process-wide CompiledFunction; required: a compile failure is a
    CompileFailed (a UserError) instead of a warning and the eager path."""
    return functools.partial(compiled(fn, dynamic), required=required) if on else fn


def compile_seconds(fn, dynamic):
    """Seconds of the calls that compiled the process's compiled `fn` so far (0.0 if it was never compiled)."""
    return _COMPILED[(fn, dynamic)].seconds if (fn, dynamic) in _COMPILED else 0.0


def generated_kernels(fn, dynamic):
    """What one call of each graph of the process's compiled `fn` so far launches (CompiledFunction's kernels:
    GraphKernels or None; [] if it was never compiled)."""
    return list(_COMPILED[(fn, dynamic)].kernels) if (fn, dynamic) in _COMPILED else []


def compile_totals():
    """(graphs compiled, seconds of the calls that compiled) over every compiled function of the process."""
    return sum(c.compiles for c in _COMPILED.values()), sum(c.seconds for c in _COMPILED.values())


class CompileClock:
    """compile_totals() from the clock's start (what a run compiled; earlier runs in the process are not its own) and
    in laps (what a step or an eval compiled): (graphs compiled, seconds of the calls that compiled)."""

    def __init__(self):
        self.start = self.last = compile_totals()

    def lap(self):
        """Since the last lap, or since the start."""
        lap, self.last = _since(self.last), compile_totals()
        return lap

    def total(self):
        """Since the start."""
        return _since(self.start)


def _since(then):
    now = compile_totals()
    return now[0] - then[0], now[1] - then[1]


class CompilePlan(NamedTuple):
    """What a run compiles, and why (printed at its start). A part the run does not have is None, not False:
    chat_eval trains nothing; chat_sft samples only for --stop-at-pass1."""
    decode: Optional[bool]  # the static decode step (only static and graph decode modes run it)
    train: Optional[bool]   # the training pass's forward
    why: str
    blocks: bool = False    # each transformer block's regions around its attention (--compile=blocks), alone
    measured: bool = False  # auto decided during the run, part by part, from its own timings (compile_rule.py)

    @property
    def compiles(self):
        return bool(self.decode or self.train or self.blocks)

    def nothing(self, why):
        """This plan with every part it has turned off."""
        return CompilePlan(None if self.decode is None else False, None if self.train is None else False, why)

    def describe(self):
        """The line a script prints at its start, one entry per part the run has."""
        parts = [f"{name} {'on' if on else 'off'}" for name, on in (("decode step", self.decode),
                                                                    ("training forward", self.train)) if on is not None]
        if self.measured:
            return (f"compile: nothing yet; each part timed eagerly over the first steps, then compiled where its "
                    f"saving pays for its compile ({self.why}; --compile to choose)")
        if self.blocks:
            parts = ["each transformer block around its attention, one compile for every layer (the decode step "
                     "and the training forward around them run as they are)"]
        return f"compile: {', '.join(parts) or 'nothing to compile'} ({self.why}; --compile to choose)"


def compile_block_regions(model, on=True, required=False):
    """From now on `model`'s blocks run their regions before and after attention compiled (--compile=blocks): two
    functions of (block, tensors), whose graphs every layer shares (Dynamo guards on a module argument's
    attributes, not its identity; the layer index and window, which differ between layers, stay outside them in
    the attention context's call). Dynamic shapes: rows and lengths change from call to call. The whole decode
    step or training forward compiled (--compile=on) is one graph per shape class of the whole model, which took
    minutes on a GPU for a d20; a block's regions are a twentieth of it. on=False: back to the eager regions.
    required: as maybe_compiled's."""
    model.block_regions = BlockRegions(*(maybe_compiled(fn, on, dynamic=True, required=required)
                                         for fn in EAGER_REGIONS))


# a CPU run of chat_rl compiles its training forward from this many steps on (--compile=auto): on a 2-core CPU
# (a d4 model, every row of 16 questions x 16 samples trained) the compiled forward saves about a quarter of a step's
# training phase, after a minute or so of compiling with a cold Inductor cache: even at a quarter of that saving per
# step (smaller models, fewer trained rows) a run of this length pays for its compile
CPU_MIN_STEPS = 50
# chat_sft's forward and loss pay later: its steps are short, and compiling saves a tenth to a fifth of each, so it
# takes about this many steps to make up a cold compile (docs/performance.md)
SFT_CPU_MIN_STEPS = 500
# a CPU run of chat_rl compiles its static decode step from this many steps on (--compile=auto; with --decode=auto
# it then decodes with that step, see run_decode_mode). On a 2-core CPU with native bf16 (a d4 SFT model on
# arithmetic, bf16 rollouts) the compiled step saves a fraction of a second a step over the eager exact-shape step,
# and its graphs (all rows, some, one; the eval's batch) compile in under two minutes with a cold Inductor cache,
# well under one warm: a cold compile pays back within a few hundred steps, a warm one within 150
# (docs/performance.md). 300 keeps the default GSM8K run (467 steps) and leaves short trial runs uncompiled
CPU_DECODE_MIN_STEPS = 300


def compile_plan(mode, device, decode=None, num_steps=None, trains=True, cpu_min_steps=CPU_MIN_STEPS, measured=False):
    """The CompilePlan of --compile=`mode` on `device` for a run of `num_steps` steps (None: long) that decodes in
    mode `decode` (cuda_graphs.decode_mode's answer; None: it samples nothing) and, if `trains`, runs a training
    forward. auto: on CUDA nothing, until measured to pay there (on the first H100 runs the d20 static decode step
    took minutes to compile, against an uncompiled step replayed from CUDA graphs in milliseconds;
    docs/performance.md; `tests/gpu_check.sh compiled` measures it); on a CPU the training forward for a run of at
    least `cpu_min_steps` steps, from which it was measured to pay for its compile there (CPU_MIN_STEPS for chat_rl,
    SFT_CPU_MIN_STEPS for chat_sft), and the static decode step (--decode=static; chat_rl's --decode=auto becomes it,
    see run_decode_mode) for a training run of at least CPU_DECODE_MIN_STEPS steps (not for chat_eval's or the SFT
    checks' sampling alone: not measured to pay there); elsewhere (MPS) nothing: not measured. on: both where they
    apply (the decode step only in static and graph modes: the eager step's exact shapes would compile at every new
    shape). measured (chat_rl): auto on a CPU compiles nothing at the start and decides each part during the run from
    its own timings (nanochat/model/compile_rule.py), in place of the step thresholds."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")

    def plan(compile_decode, compile_train, why):  # only the parts the run has; the decode step only where static
        return CompilePlan(None if decode is None else compile_decode and decode in ("static", "graph"),
                           compile_train if trains else None, why)
    if mode == "off":
        return plan(False, False, "--compile=off")
    if mode == "blocks":
        return CompilePlan(None if decode is None else False, False if trains else None, "--compile=blocks", True)
    if mode == "on":
        return plan(True, True, "--compile=on" + ("; the eager decode step is not compiled" if decode == "eager" else ""))
    if device.type == "cuda":
        return plan(False, False, "auto on CUDA: not yet measured to pay there (tests/gpu_check.sh compiled "
                                  "measures it); --compile=on to compile")
    if device.type != "cpu":
        return plan(False, False, f"auto on {device.type}: not measured there")
    if measured and trains:
        return CompilePlan(None if decode is None else False, False, "auto on a CPU", measured=True)
    if not trains:
        return plan(False, False, "auto on a CPU: not the decode step (it applies to --decode=static only; "
                                  "--compile=on to compile it)")
    if num_steps is not None and num_steps < cpu_min_steps:
        return plan(False, False, f"auto on a CPU: {num_steps} steps are too few to pay for compiling "
                                  f"(from {cpu_min_steps} on)")
    why = f"auto on a CPU with {num_steps or 'many'} steps: the training forward (measured to pay from {cpu_min_steps} steps)"
    if decode is None:
        return plan(False, True, why)
    if decode != "static":
        return plan(False, True, why + "; not the eager decode step (its exact shapes change every step)")
    if num_steps is not None and num_steps < CPU_DECODE_MIN_STEPS:
        return plan(False, True, why + f"; not the decode step (it pays from {CPU_DECODE_MIN_STEPS} steps)")
    return plan(True, True, why + f" and the static decode step (from {CPU_DECODE_MIN_STEPS})")


def run_decode_mode(decode_flag, decode, compile_mode, device, num_steps, dtype="bfloat16", measured=False):
    """The decode mode a chat_rl run of num_steps steps uses for --decode=`decode_flag`, whose mode is `decode`
    (cuda_graphs.decode_mode's answer: auto is graph on CUDA, eager elsewhere), except that auto on a CPU is static
    where --compile=`compile_mode` compiles the static step for such a run (compile_plan: auto from
    CPU_DECODE_MIN_STEPS steps, on always) and it trains in bf16 (`dtype`, its rollouts then too): compiled in bf16,
    the static step is the faster one there, uncompiled the exact-shape eager step is; in fp32 the compiled step's
    gain is too small to pay for its compile (docs/performance.md). measured: see compile_plan (the run starts with the
    uncompiled mode)."""
    if (decode_flag == "auto" and device.type == "cpu" and dtype == "bfloat16"
            and compile_plan(compile_mode, device, "static", num_steps, measured=measured).decode):
        return "static"
    return decode


def check_compiler(device):
    """Why torch.compile cannot run on `device` here (a one-line reason), or None when it can: compiles and runs
    a two-operation function once (cached on disk by Inductor after the first time)."""
    probe = compiled(_probe, dynamic=False, announce=False)  # a check, not a part of the run: said only if it fails
    x = torch.ones(4, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = probe(x)
        except Exception as error:  # anything that stops the probe (a broken toolchain, a torch build that lacks
            return first_line(error)  # what the device reports) means: no compiling here
    if probe.failed is not None:
        return probe.failed
    if not torch.equal(out.cpu(), torch.full((4,), 3.0)):
        return "a compiled probe computed a wrong result"
    return None


def resolve_compile(mode, device, *plan_args, **plan_kwargs):
    """The CompilePlan a run uses (compile_plan's, of the same arguments), after checking that torch.compile works on
    `device` when the plan compiles anything: where it does not, --compile=on or blocks fails (CompileFailed) and
    auto warns in one line and compiles nothing. Under a process group every rank takes the same plan: each probes
    its own toolchain, and where any fails, none compiles (ranks deciding apart would run different code, and in
    chat_rl different collectives, next)."""
    plan = compile_plan(mode, device, *plan_args, **plan_kwargs)
    if not plan.compiles:  # a measured plan too: most such runs never compile, and a part that fails to compile
        return plan        # later warns once and runs eagerly (CompiledFunction)
    reason = check_compiler(device)
    if dist.is_initialized():
        works = torch.tensor([int(reason is None)], device=collective_device(device))
        dist.all_reduce(works, op=dist.ReduceOp.MIN)
        if reason is None and not works.item():
            reason = "it failed on another rank"
    if reason is None:
        return plan
    if mode in ("on", "blocks"):  # asked for by name: an error, not a silently eager run
        raise CompileFailed(f"torch.compile does not work on {device.type} here ({reason})")
    warnings.warn(f"torch.compile does not work on {device.type} here ({reason}); running eagerly", stacklevel=2)
    return plan.nothing(f"{mode}: torch.compile unavailable ({reason})")


def _probe(x):
    return x * 2 + 1


def resolve_compile_flag(mode, device, *plan_args, **plan_kwargs):
    """--compile=`mode` for this run (compile.resolve_compile with compile_plan's arguments), printed with why.
    Returns (the CompilePlan, whose models a script hands to compile_models; the mode that runs: `mode`, or off where
    the plan compiles nothing (torch.compile unavailable under auto, or nothing that pays here), so that a run records
    what runs and an engine given it compiles nothing)."""
    plan = resolve_compile(mode, device, *plan_args, **plan_kwargs)
    print0(plan.describe())
    return plan, mode if plan.compiles or plan.measured else "off"


def compile_models(plan, *models):
    """Where `plan` compiles blocks (--compile=blocks), each of `models` runs its block regions compiled
    (compile_block_regions; a failure to compile is an error, as with --compile=on)."""
    for model in models if plan.blocks else ():
        compile_block_regions(model, required=True)
