"""
The command-line layer shared by the scripts: the argument parser, the flags several scripts declare,
and `run_main`, which turns a UserError into one line on stderr.

This is the one library module that names flags and scripts. Library errors carry facts (the path, the
available steps or tags, what was found); HINTS below adds, per error type, which flag to change or which
script to run. A SettingError (a bad value of a function argument such as device_type) is shown under
the name of its flag (--device-type).
"""

import argparse
import os
import sys
import traceback

from nanochat.checkpoints.errors import (CorruptCheckpointError, MissingMetaError, NoCheckpointsError, NoStepsError,
                                         RankLostError, UnknownStepError, UnknownTagError)
from nanochat.common import SettingError, UserError, cleanup_after_error, get_rank
from nanochat.engine.cuda_graphs import DECODE_MODES
from nanochat.engine.memory_budget import AUTO, FIXED_GB, FRACTION, NoMemoryForRolloutsError, parse_budget
from nanochat.model.compile import COMPILE_MODES, SFT_CPU_MIN_STEPS, CompileFailed
from nanochat.rl.plan import AUTO_TRAIN_ROWS, OTHER_AUTO_TRAIN_ROWS
from nanochat.stop_rule import BandNotReachedError, JumpedOverBandError
from nanochat.tokenizer import TokenizerError
from nanochat.wandb_utils import WandbStartError
from tasks.gsm8k import GSM8KUnavailableError
from tasks.registry import TaskNotFoundError


class ArgumentParser(argparse.ArgumentParser):
    """argparse with nanochat's error convention: a bad flag is one line (and exit 2), not the usage block;
    and no silent prefix matching (`--num-step` must not quietly mean `--num-steps`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UserError(f"{message} (see --help)")


# -----------------------------------------------------------------------------
# flags several scripts share

def add_debug_flag(parser):
    """--debug, in every script: run_main then re-raises a UserError, so the full traceback is shown.
    run_main reads it through this same declaration (see debug_requested). Returns the parser."""
    parser.add_argument("--debug", action="store_true", help="show full tracebacks instead of one-line errors")
    return parser


def add_runtime_flags(parser, wandb_run=True):
    """--run (with wandb_run), --device-type and --dtype: where and in what precision a training script runs."""
    if wandb_run:
        parser.add_argument("--run", type=str, default="dummy", help="wandb run name ('dummy' disables wandb)")
    parser.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (empty = autodetect)")
    parser.add_argument("--dtype", type=str, default=None,
                        help="auto|float32|bfloat16 compute dtype (autocast; chat_rl also float16, with dynamic loss "
                             "scaling); default: $NANOCHAT_DTYPE, else auto: bfloat16 on a GPU (in chat_rl float16 on "
                             "one without native bf16, before SM 80), on a CPU bfloat16 only where it is native "
                             "(AVX512-BF16, AMX) and, in chat_rl, measured faster at the start")


def add_decode_flag(parser, auto_note=""):
    """--decode: how the rollout engine runs its decode step (nanochat.engine.engine.decode_mode). Uncompiled, the tokens
    are the same in every mode; only the speed differs (compiled, a near-tie may fall the other way). auto_note: what
    the script's auto does besides (its help)."""
    parser.add_argument("--decode", type=str, default="auto", choices=DECODE_MODES,
                        help=f"decode step of rollouts: auto (graph on CUDA, eager elsewhere{auto_note}), eager (exact "
                             "shapes), static (bucketed shapes, eagerly), graph (bucketed shapes replayed from CUDA graphs)")


def add_memory_budget_flag(parser):
    """--memory-budget-gb: the KV cache the rollout batches in memory at once may use; resolve it with
    nanochat.engine.memory_budget.resolve_memory_budget before building the Engine, which takes GiB."""
    parser.add_argument("--memory-budget-gb", type=parse_budget, default=AUTO,
                        help=f"KV-cache memory (GiB) the rollout batches in memory at once (a step's, an eval's kept beside it) may use together; auto (the default): on CUDA {FRACTION:g} of "
                             f"the memory free after the model, optimizer state and a training-peak reserve (stated "
                             f"at the start), elsewhere {FIXED_GB:g}")


def add_train_rows_flag(parser):
    """--train-rows: trained rows per training forward (read it with train_rows)."""
    parser.add_argument("--train-rows", type=int, default=0,
                        help=f"trained rows per training forward, taken from one question or several in turn (0 = "
                             f"auto: {AUTO_TRAIN_ROWS['cuda']} on CUDA, {OTHER_AUTO_TRAIN_ROWS} elsewhere, or "
                             "--device-batch-size if larger). The gradient is the same for any value: each row keeps the denominator of its --device-batch-size pass. More "
                             "rows make larger matmuls and fewer forwards (on a GPU, fewer and fuller kernels) and "
                             "need more memory; halved on out-of-memory")


def add_compile_flag(parser):
    """--compile: whether the static decode step and the training pass run compiled (nanochat/model/compile.py's
    compile_plan), those of them the script runs."""
    parser.add_argument("--compile", type=str, default="auto", choices=COMPILE_MODES,
                        help=f"torch.compile the static decode step and the training forward, where the script runs "
                             f"them: auto (on CUDA nothing yet: not measured to pay there; on a CPU, chat_rl: each "
                             f"part timed eagerly over the first steps, then compiled where its saving over the steps "
                             f"left pays for its compile; chat_sft: the training forward for runs of "
                             f"{SFT_CPU_MIN_STEPS} steps or more), on (an "
                             f"error where compiling is unavailable), off, or blocks (instead: each transformer "
                             f"block around its attention, one compile for every layer)")


def add_optimizer_flags(parser):
    """The learning-rate flags chat_rl and chat_sft share (nanochat's defaults; --init-lr-frac differs)."""
    parser.add_argument("--embedding-lr", type=float, default=0.2, help="AdamW lr for the token embedding")
    parser.add_argument("--unembedding-lr", type=float, default=0.004, help="AdamW lr for lm_head")
    parser.add_argument("--matrix-lr", type=float, default=0.02, help="Muon lr for the transformer matrices")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="Muon weight decay")
    parser.add_argument("--recipe", type=str, default="2026-01", choices=("2026-01", "2026-07"),
                        help="optimizer recipe: 2026-01 (nanochat of January 2026: AdamW + Muon) or 2026-07 "
                             "(nanochat of July 2026: MuonAdamW with per-group betas and weight decay)")


def add_model_generation_flag(parser):
    """--model-generation, for every script that loads a checkpoint (see nanochat/model/generations.py)."""
    from nanochat.model.generations import VE_ERA_WITH_NEW_META
    parser.add_argument("--model-generation", type=str, default=None, choices=VE_ERA_WITH_NEW_META,
                        help="which forward a value-embedding checkpoint with nanochat's 2026-01-31+ meta layout was "
                             "trained with (its files cannot tell): ve (to 2026-03-01), ve_mar2 (03-02..03-03), "
                             "ve_late (03-04..03-08, the default); every other checkpoint's generation is detected")


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
}


def flag_name(setting):
    """The flag argparse derives a setting from: device_type <- --device-type."""
    return "--" + setting.replace("_", "-")


def error_line(e):
    """What run_main prints for the UserError e (without 'error: '): its message, under the flag's name
    for a SettingError, followed by the hint HINTS has for its type (or the nearest base type), if any."""
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
