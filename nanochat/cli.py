"""
The command-line layer shared by the scripts: the argument parser (chat_rl's built from RLConfig's fields), the flags
several scripts declare (from their settings, nanochat/settings.py), and `run_main`, which turns a UserError into one
line on stderr.

Library errors carry facts (the path, the available steps or tags, what was found); HINTS below adds, per error type,
which flag to change or which script to run, and LINES writes the whole line of an error whose flags sit inside its
sentence. A SettingError (a bad value of a function argument such as device_type) is shown under the name of its flag
(--device-type)."""

import argparse
import dataclasses
import os
import sys
import traceback

from nanochat.checkpoints.errors import (CorruptCheckpointError, MissingMetaError, NoCheckpointsError, NoStepsError,
                                         RankLostError, UnknownStepError, UnknownTagError)
from nanochat.compiling.functions import CompileFailed
from nanochat.engine.cuda_graphs import GraphsNeedCudaError
from nanochat.engine.decode_steps import DecodeKernelsError
from nanochat.engine.spec import NoMemoryForRolloutsError
from nanochat.errors import SettingError, UserError
from nanochat.rl.config import GROUPS, RLConfig
from nanochat.rl.resume import (LongerRunError, NoStartCheckpointError, ResumeError, RunExistsError,
                                TeacherInRunDirError, given_flag)
from nanochat.rl.run import NonFiniteStepsError
from nanochat.runtime.distributed import cleanup_after_error, get_rank
from nanochat.settings import SCRIPT_DEFAULTS, SHARED
from nanochat.sft.plan import TooFewConversationsError
from nanochat.sft.saving import LaterStepSavedError
from nanochat.sft.stopping import NotGenerativeError
from nanochat.stop_rule import BandNotReachedError, JumpedOverBandError
from nanochat.tokenizer import TokenizerError
from nanochat.wandb_utils import WandbStartError
from tasks.gsm8k import GSM8KUnavailableError
from tasks.registry import TaskNotFoundError


class DefaultsShown(argparse.HelpFormatter):
    """--help with each flag's default after its help, where the help does not say it already: 0 and 0.0 too (once
    hidden as equal to False), an empty string as `empty`. Not for a switch (off unless given) or a None default,
    whose help says in words what happens without the flag (tests/scripts/test_help.py holds every script to it)."""

    def _get_help_string(self, action):
        default = action.default
        if action.nargs == 0 or default is None or default is argparse.SUPPRESS or "default" in (action.help or ""):
            return action.help
        return f"{action.help} (default: {'empty' if default == '' else '%(default)s'})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with nanochat's error convention: a bad flag is one line (and exit 2), not the usage block;
    no silent prefix matching (`--num-step` must not quietly mean `--num-steps`); and --help showing each flag's
    default (DefaultsShown), in every script."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UserError(f"{message} (see --help)")


# -----------------------------------------------------------------------------
# flags, declared from their settings (nanochat/settings.py; chat_rl's: nanochat/rl/config.py)

def add_settings(parser, settings):
    """A flag for each of `settings` (name -> Setting), in their order. Returns the parser."""
    for name, setting in settings.items():
        parser.add_argument(flag_name(name), **setting.argparse_kwargs())
    return parser


def add_shared(parser, *names):
    return add_settings(parser, {name: SHARED[name] for name in names})


def add_shared_flag(parser, name, *aliases, script=None, **changes):
    """The flag of the shared setting `name` as `script` declares it: the setting with `changes` (its own help:
    Setting.varied) and, where the script's default differs on purpose, SCRIPT_DEFAULTS' (settings.py), and `aliases`,
    its other option strings, before its name (chat_cli's -t --temperature; the first long one names the value).
    Returns the parser."""
    own = SCRIPT_DEFAULTS.get(script, {})
    changes = {"default": own[name], **changes} if name in own else changes
    parser.add_argument(*aliases, flag_name(name), **SHARED[name].varied(**changes).argparse_kwargs())
    return parser


def rl_parser(description="RL on GSM8K (or --task) with on-policy policy gradients"):
    """chat_rl's parser, built from RLConfig's fields: their defaults and help, in --help's groups (GROUPS)."""
    parser = ArgumentParser(description=description)
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for field in dataclasses.fields(RLConfig):
        setting = field.metadata["setting"]
        add_settings(groups[setting.group], {field.name: setting})
    return parser


def parse_rl_args(argv):
    """chat_rl's flags parsed (an argparse Namespace; RLConfig.from_flags checks them)."""
    return rl_parser().parse_args(argv)


def given_flags(parser, argv):
    """The settings (destinations) whose flags argv names, given a default or not: argv parsed again by `parser` (a
    fresh one: this changes it) with every default suppressed, so that only what the command line set is there
    (--resume says which of them it replaced)."""
    for action in parser._actions:  # (not set_defaults, whose values argparse would put in the namespace)
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


def add_debug_flag(parser):
    """--debug, in every script: run_main then re-raises a UserError, so the full traceback is shown.
    run_main reads it through this same declaration (see debug_requested). Returns the parser."""
    return add_shared(parser, "debug")


def add_runtime_flags(parser, wandb_run=True):
    """--run (with wandb_run), --device-type and --dtype: where and in what precision a training script runs."""
    return add_shared(parser, *(("run",) if wandb_run else ()), "device_type", "dtype")


def add_decode_flag(parser):
    """--decode: how the rollout engine runs its decode step (settings.decode_setting)."""
    return add_shared(parser, "decode")


def add_decode_kernels_flag(parser):
    """--decode-kernels: which decode step the rollout engine runs (nanochat/engine/decode_steps.py)."""
    return add_shared(parser, "decode_kernels")


def add_memory_budget_flag(parser):
    """--memory-budget-gb: the KV cache the rollout batches in memory at once may use."""
    return add_shared(parser, "memory_budget_gb")


def add_compile_flag(parser):
    """--compile: whether the static decode step and the training pass run compiled."""
    return add_shared(parser, "compile")


def add_optimizer_flags(parser):
    """The learning-rate flags chat_rl and chat_sft share (nanochat's defaults; --init-lr-frac differs)."""
    return add_shared(parser, "embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay", "recipe")


def add_model_generation_flag(parser):
    """--model-generation, for every script that loads a checkpoint (see nanochat/model/generations.py)."""
    return add_shared(parser, "model_generation")


# -----------------------------------------------------------------------------
# errors: the library's facts, then what to change on the command line

# the script that writes each checkpoint family (base and mid are nanochat's own)
PRODUCERS = {"base": "scripts.base_train", "mid": "scripts.mid_train", "sft": "scripts.chat_sft", "rl": "scripts.chat_rl"}

# error type -> the hint after its message: a string, or a function of the error
HINTS = {
    NoCheckpointsError: lambda e: f"or create one with `python -m {PRODUCERS[e.source]}`",
    UnknownTagError: "pick one with --model-tag",
    NoStepsError: "pick another --model-tag, or train or copy a checkpoint there",
    UnknownStepError: "pick one with --model-step",
    MissingMetaError: "copy the meta file too, or pick another --model-step",
    CorruptCheckpointError: "delete it or pick another --model-step",
    RankLostError: "once every rank is back, continue with --resume",
    TokenizerError: "or train a nanochat tokenizer with `python -m scripts.tok_train`",
    WandbStartError: "or pass --run=dummy to turn wandb off",
    GSM8KUnavailableError: "or run `python -m scripts.prepare_gsm8k --from DIR`",
    TaskNotFoundError: "check --task (chat_sft: --tasks)",
    JumpedOverBandError: "check more often (a smaller --stop-check-every) or widen the band of --stop-at-pass1",
    CompileFailed: "use --compile=off (or auto, which falls back to eager with a warning)",
    BandNotReachedError: "allow more steps (a larger --num-steps) or lower the band of --stop-at-pass1",
    NoMemoryForRolloutsError: "pass --memory-budget-gb=N to choose the KV cache's size, or lower --device-batch-size",
    TeacherInRunDirError: "write the new run elsewhere with --output-tag=<new name>",
    RunExistsError: "continue it with --resume, write the new run beside it with --output-tag=<new name>, or delete "
                    "those files for good and start over with --overwrite",
    NonFiniteStepsError: "lower the learning rates or use --dtype=float32",
}


def resume_line(e):
    """A ResumeError's line: the flag (with its value where the value's form is the problem), the facts, the fix."""
    others = [s for s in e.steps if s != e.step]
    if e.fix == "saved step":
        fix = f" (e.g. --resume={e.tag}:{e.steps[-1]})"
    elif e.fix == "another step" and others:
        fix = (f"; resume another saved step (--resume={e.tag}:{others[-1]}; saved: {', '.join(map(str, others))}) or "
               f"start a new run with --overwrite")
    else:
        fix = {None: "", "new run": "; start one without --resume", "overwrite": "; start a new run with --overwrite",
               "another step": "; no other step of this run is saved: start a new run with --overwrite"}[e.fix]
    return f"--resume{'=' + e.spec if e.spec else ''}: {e}{fix}"


def decode_kernels_line(e):
    """A DecodeKernelsError's line: the facts under the flag, then what to pass instead (and, where --compile=on is
    what rules the step out, that flag too)."""
    compile_fix = ", or --compile=off or auto (which compile nothing of it)" if e.conflict == "compile" else ""
    return f"--decode-kernels {e.problem}; use --decode-kernels=auto or torch (the hand-written step){compile_fix}"


# error type -> its whole line, written from its facts: errors whose flags sit inside the sentence
LINES = {
    DecodeKernelsError: decode_kernels_line,
    ResumeError: resume_line,
    LongerRunError: lambda e: (f"{given_flag(e.setting, e.value)}: run {e.tag} was planned with {e.planned} steps, over "
                               f"which its learning rate decays (--lr-schedule={e.schedule}), and --resume continues it "
                               f"to that end, not further; to train it further, start a new run from its last "
                               f"checkpoint: {e.further}"),
    GraphsNeedCudaError: lambda e: (f"--decode {e.problem} (torch sees no CUDA device, or --device-type chose another); "
                                    f"use --decode=static (the same step, run eagerly) or --decode=auto"),
    NoStartCheckpointError: lambda e: ("--kl-coef > 0 needs the checkpoint the run started from, and this run's meta "
                                       "does not record it (written before --kl-coef existed); resume it with its own "
                                       "flags or start a new run"),
    # chat_sft's
    TooFewConversationsError: lambda e: (f"--tasks={e.tasks} has {e.conversations} train conversations, fewer than "
                                         f"--examples-per-step ({e.examples_per_step}) x --num-epochs ({e.num_epochs}); "
                                         f"lower --examples-per-step or pass --num-steps"),
    NotGenerativeError: lambda e: (f"--stop-at-pass1 samples answers to the first task of --tasks, but {e.task_name!r} "
                                   f"is {e.eval_type}, not generative; put a generative task (gsm8k, arithmetic) first "
                                   f"in --tasks"),
    LaterStepSavedError: lambda e: (f"{e}, so `--source=sft` would keep loading that one; pass --output-tag=<new tag> "
                                    f"or move it away"),
}


def flag_name(setting):
    """The flag argparse derives a setting from: device_type <- --device-type."""
    return "--" + setting.replace("_", "-")


def error_line(e):
    """What run_main prints for the UserError e (without 'error: '): the line LINES writes for its type; else its
    message, under the flag's name for a SettingError, followed by the hint HINTS has for its type (or the nearest
    base type), if any."""
    if type(e) in LINES:
        return LINES[type(e)](e)
    message = f"{flag_name(e.setting)} {e.problem}" if isinstance(e, SettingError) else str(e)
    hint = next((HINTS[cls] for cls in type(e).__mro__ if cls in HINTS), None)
    if hint is None:
        return message
    return f"{message}; {hint(e) if callable(hint) else hint}"


def debug_requested(argv):
    """True when argv holds --debug (as add_debug_flag declares it) or NANOCHAT_DEBUG=1. Read before the
    script parses its flags, so that an error of the parser itself can show its traceback too."""
    if os.environ.get("NANOCHAT_DEBUG") == "1":
        return True
    try:
        return add_debug_flag(ArgumentParser(add_help=False)).parse_known_args(argv)[0].debug
    except UserError:
        return False  # a malformed --debug (--debug=1): the script's own parser reports it


def run_main(main, argv=None):
    """Run a script's `main(argv)`; turn a UserError into one line on stderr (error_line) and exit code 2.
    With --debug (or NANOCHAT_DEBUG=1) the UserError is re-raised, so the full traceback is shown."""
    argv = sys.argv[1:] if argv is None else argv
    debug = debug_requested(argv)
    try:
        return main(argv)
    except UserError as e:
        if debug:
            raise
        if get_rank() == 0:  # every rank hits the same validation error; say it once
            print(f"error: {error_line(e)}", file=sys.stderr, flush=True)
        cleanup_after_error()
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        cleanup_after_error()
        sys.exit(130)
    except Exception:
        traceback.print_exc()
        cleanup_after_error()
        sys.exit(1)
