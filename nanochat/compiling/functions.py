"""
A function compiled once per process (torch.compile), counting what its compiles cost and what they launch.

A compiled function counts its compiles (graphs handed to Inductor) and the seconds of the calls that compiled
(tracing, Inductor and its C++ or Triton compile, and the call itself: the first-call cost a run pays). Both
are shared by every caller in the process, as Dynamo's cache is (it is kept per function): a second engine
or model of the same shapes reuses the graphs. Inductor also keeps its compiled kernels on disk
(TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER), so a second run compiles much faster.

Where compiling fails (no C++ compiler on a CPU, an operation Dynamo or Inductor cannot take), the function
says so in one warning line and runs eagerly from then on; with required=True (--compile=on) the failure is a
UserError instead. Errors of the computation itself (an out-of-memory included) are never caught.

Which functions a run compiles is its plan (nanochat/compiling/plan.py).
"""

import functools
import os
import sysconfig
import time
import warnings

import torch

from nanochat.compiling.inductor_code import GraphKernels, inductor_code_to
from nanochat.errors import UserError
from nanochat.runtime.device import out_of_memory_within
from nanochat.runtime.distributed import print0

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
