"""
The decode steps an engine can run its batches with, by name: one table (DECODE_STEPS) that everything choosing a step
reads, the engine (its step function: engine.decode_step_function), make_batch (the shared-prompt cache's per-step
object) and the meta op counter (nanochat/diagnostics/op_count.py) alike. The setting decode_kernels (RolloutSpec's
field, the scripts' --decode-kernels) names one:

    torch   the hand-written step in torch ops (decode_batch.static_step; over the shared-prompt cache its
            SharedPromptStep), compiled where the spec compiles the static step
    flex    the same with the shared-prompt attention through FlexAttention (variants/flex_prompt_attention.py), a
            benchmark's variant (bench_rl's *_flex configs)
    triton  the whole step in the project's own Triton kernels (variants/triton_step.py over nanochat/kernels/: 218
            kernels a d20 step on `meta` against the torch step's 1,152), never compiled: its kernels are the fusion
    auto    the default, resolved once (resolve_decode_kernels, in spec.py's resolve_rollout_spec): torch everywhere
            for now. The Triton step has not been timed on a GPU yet (it is meant to be auto's choice on CUDA once a
            GPU's figures show it faster: issue 73), and a CPU runs it only in Triton's interpreter, far too slowly.

A step asked for where it cannot run (the Triton step on a CPU without the interpreter, on a model whose token
embedding is not fp32, compiled, or a step of the shared-prompt cache without shared prompts) is refused in one line
(DecodeKernelsError): by the scripts before the model loads where the device tells (check_decode_kernels), by the
engine where it is built.
"""

from dataclasses import dataclass
from typing import Callable, Optional

from nanochat.engine.decode_batch import static_step
from nanochat.engine.shared_prompt_cache import FlexPromptStep, SharedPromptStep
from nanochat.engine.variants.triton_step import KernelPromptStep, check_kernel_model, kernel_static_step
from nanochat.errors import SettingError
from nanochat.kernels.launch import kernels_unavailable

AUTO = "auto"


class DecodeKernelsError(SettingError, ValueError):
    """A decode step asked for where it cannot run. The message states the facts (nanochat.cli adds the flags to
    change); a ValueError too, as a spec refuses its other settings. conflict: the other setting it cannot go with
    ("compile"), or None."""

    def __init__(self, problem, conflict=None):
        super().__init__("decode_kernels", problem)
        self.conflict = conflict


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of the table: what builds it, and where it can run."""
    name: str
    static_step: Callable      # (batch, rows, keys): one step of a DecodeBatch's rows (decode_batch.static_step's form)
    cache_step: type           # the shared-prompt cache's per-step object: (cache view, keys, whole cache) -> CacheStep
    compiles: bool = True      # its static step may run compiled; else never (a compiled spec is refused)
    shared_prompts_only: bool = False  # it runs over the shared-prompt cache only
    unavailable: Optional[Callable] = None  # device -> why it cannot run there, or None where it can
    check_model: Optional[Callable] = None  # model -> a ValueError where it cannot compute that model

    def check(self, share_prompts=True, compiled=False):
        """A DecodeKernelsError where a spec's other settings rule this step out."""
        if self.shared_prompts_only and not share_prompts:
            raise DecodeKernelsError(f"is {self.name}, a step of the shared-prompt cache: it needs share_prompts=True")
        if compiled and not self.compiles:
            raise DecodeKernelsError(f"is {self.name}, whose step is never compiled (its kernels are the fusion), and "
                                     f"the static step is asked compiled (compile on)", conflict="compile")

    def check_device(self, device):
        """A DecodeKernelsError where the step cannot run on `device` (a torch.device)."""
        why = self.unavailable and self.unavailable(device)
        if why:
            raise DecodeKernelsError(f"is {self.name}: {why}")

    def check_runs(self, model):
        """A DecodeKernelsError where the step cannot compute `model` on its device."""
        self.check_device(model.get_device())
        if self.check_model is None:
            return
        try:
            self.check_model(model)
        except ValueError as e:
            raise DecodeKernelsError(f"is {self.name}: {e}") from None


DECODE_STEPS = {step.name: step for step in (
    DecodeStep("torch", static_step, SharedPromptStep),
    DecodeStep("flex", static_step, FlexPromptStep, shared_prompts_only=True),
    DecodeStep("triton", kernel_static_step, KernelPromptStep, compiles=False, shared_prompts_only=True,
               unavailable=kernels_unavailable, check_model=check_kernel_model),
)}
DECODE_KERNELS = (AUTO,) + tuple(DECODE_STEPS)  # the setting's choices


def decode_step_of(name):
    """The DecodeStep named `name` (auto resolved already), or a DecodeKernelsError naming the choices."""
    if name not in DECODE_STEPS:
        raise DecodeKernelsError(f"must be one of {', '.join(DECODE_KERNELS)}, got {name!r}"
                                 + (" (resolve it first: resolve_decode_kernels)" if name == AUTO else ""))
    return DECODE_STEPS[name]


def resolve_decode_kernels(name, device):
    """The step's name `name` runs on `device`: auto's choice, torch on every device for now (the module docstring:
    the Triton step has not been timed on a GPU yet); any other name itself, once checked."""
    if name == AUTO:
        return "torch"
    return decode_step_of(name).name


def check_decode_kernels(name, device, share_prompts=True, compiled=False):
    """The name of the step `name` runs on `device` (resolve_decode_kernels), or a one-line DecodeKernelsError where
    it cannot run there with those settings: what a script checks once it knows its device, before a model loads
    (minutes) to find out."""
    step = decode_step_of(resolve_decode_kernels(name, device))
    step.check(share_prompts, compiled)  # first: a combination no device allows
    step.check_device(device)
    return step.name
