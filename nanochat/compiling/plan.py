"""
What a run compiles (its CompilePlan), for a run's two hot paths, and the rule of --compile=auto|on|off|blocks.

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
  SFT's (nanochat/sft/training.py's `summed_cross_entropy`: a micro-batch's forward and summed loss) likewise.

compile_plan says what --compile=auto|on|off means on each device (chat_rl and bench_rl have both parts, chat_sft the
training forward and the decode step of its stop checks, chat_eval the decode step). chat_rl's --decode=auto on a CPU
is the static step where the plan compiles it (the engine's rule: nanochat/engine/spec.py's run_decode_mode and
rollout_decode_mode). Where chat_rl's auto is measured during the run, part by part, the rule is
nanochat/compiling/rule.py's.
"""

import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from nanochat.compiling.functions import CompileFailed, compiled, first_line, maybe_compiled
from nanochat.model.blocks import EAGER_REGIONS, BlockRegions
from nanochat.runtime.distributed import collective_device, print0

COMPILE_MODES = ("auto", "on", "off", "blocks")


class CompilePlan(NamedTuple):
    """What a run compiles, and why (printed at its start). A part the run does not have is None, not False:
    chat_eval trains nothing; chat_sft samples only for --stop-at-pass1."""
    decode: Optional[bool]  # the static decode step (only static and graph decode modes run it)
    train: Optional[bool]   # the training pass's forward
    why: str
    blocks: bool = False    # each transformer block's regions around its attention (--compile=blocks), alone
    measured: bool = False  # auto decided during the run, part by part, from its own timings (rule.py)

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
# it then decodes with that step, see nanochat/engine/spec.py's run_decode_mode). On a 2-core CPU with native bf16
# (a d4 SFT model on arithmetic, bf16 rollouts) the compiled step saves a fraction of a second a step over the eager
# exact-shape step, and its graphs (all rows, some, one; the eval's batch) compile in under two minutes with a cold
# Inductor cache, well under one warm: a cold compile pays back within a few hundred steps, a warm one within 150
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
    see engine/spec.py's run_decode_mode) for a training run of at least CPU_DECODE_MIN_STEPS steps (not for
    chat_eval's or the SFT checks' sampling alone: not measured to pay there); elsewhere (MPS) nothing: not measured.
    on: both where they apply (the decode step only in static and graph modes: the eager step's exact shapes would
    compile at every new shape). measured (chat_rl): auto on a CPU compiles nothing at the start and decides each part
    during the run from its own timings (nanochat/compiling/rule.py), in place of the step thresholds."""
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
    """--compile=`mode` for this run (resolve_compile with compile_plan's arguments), printed with why.
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
