"""nanochat.cli: a library error (the facts) becomes one line on stderr that adds which flag to change or
which script to run; --debug, declared once, shows the traceback instead."""

from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch

from nanochat import cli
from nanochat.checkpoints.errors import CheckpointError
from nanochat.checkpoints.loading import find_checkpoint
from nanochat.checkpoints.store import load_checkpoint
from nanochat.common import compute_init
from nanochat.engine.cuda_graphs import check_decode_flag
from nanochat.engine.spec import parse_budget
from nanochat.errors import UserError
from nanochat.rl.resume import Resume, RunExistsError, resolve_resume
from nanochat.rl.run import NonFiniteStepsError, load_reference
from nanochat.runtime.dtypes import requested_dtype
from nanochat.sft.plan import TooFewConversationsError
from nanochat.sft.saving import output_dir
from nanochat.sft.stopping import held_out_questions
from nanochat.tokenizer import get_tokenizer
from nanochat.wandb_utils import WandbStartError
from tasks.arithmetic import Arithmetic
from tasks.gsm8k import find_local_dir
from tasks.registry import resolve_task_class


def checkpoint_dir(base, files=(), family="chatsft_checkpoints"):
    """$base/<family>/d2 holding `files` {name: bytes}."""
    d = base / family / "d2"
    d.mkdir(parents=True)
    for name, data in dict(files).items():
        (d / name).write_bytes(data)
    return str(d)


def raise_(error):
    raise error


# name: (the library call that fails in a fresh base dir, what the printed line ends with)
CASES = {
    "no checkpoint family": (lambda base: find_checkpoint("sft"), "; or create one with `python -m scripts.chat_sft`"),
    "unknown tag": (lambda base: checkpoint_dir(base) and find_checkpoint("sft", "d9"),
                    "available tags: d2; pick one with --model-tag"),
    "no steps": (lambda base: checkpoint_dir(base) and find_checkpoint("sft", "d2"),
                 "; pick another --model-tag, or train or copy a checkpoint there"),
    "unknown step": (lambda base: checkpoint_dir(base, {"model_000001.pt": b""}) and find_checkpoint("sft", "d2", 5),
                     "available steps: 1; pick one with --model-step"),
    "no meta": (lambda base: load_checkpoint(checkpoint_dir(base, {"model_000001.pt": b""}), 1, "cpu"),
                "no meta_000001.json; copy the meta file too, or pick another --model-step"),
    "corrupt model": (lambda base: load_checkpoint(checkpoint_dir(base, {"model_000001.pt": b"junk", "meta_000001.json": b"{}"}),
                                                   1, "cpu"),
                      "; delete it or pick another --model-step"),
    "no tokenizer": (lambda base: get_tokenizer(), "; or train a nanochat tokenizer with `python -m scripts.tok_train`"),
    "no GSM8K": (lambda base: find_local_dir("main", "train", data_dir=str(base)),
                 "; or run `python -m scripts.prepare_gsm8k --from DIR`"),
    "no task class": (lambda base: resolve_task_class("tasks.gsm8k:NoSuchClass"),
                      "has no class 'NoSuchClass' (the name after ':'); check --task (chat_sft: --tasks)"),
    "wandb refused": (lambda base: raise_(WandbStartError("r", "no API key")), "; or pass --run=dummy to turn wandb off"),
    "bad dtype": (lambda base: requested_dtype("fp8"), "error: --dtype must be auto, float32 or bfloat16, got 'fp8'"),
    "unknown device": (lambda base: compute_init("tpu"),
                       "error: --device-type 'tpu' is unknown; use cuda, cpu or mps (or leave it empty to autodetect)"),
    # chat_rl's, below its config (issue 60: their flags were in the library's messages)
    "bad budget": (lambda base: parse_budget("0"), "error: --memory-budget-gb must be auto or a number of GiB > 0, got '0'"),
    "graph off CUDA": (lambda base: check_decode_flag("graph", torch.device("cpu")),
                       "error: --decode is graph, which replays CUDA graphs, and this run is on cpu (torch sees no CUDA "
                       "device, or --device-type chose another); use --decode=static (the same step, run eagerly) or "
                       "--decode=auto"),
    "no RL run to resume": (lambda base: resolve_resume("latest"), "; start one without --resume"),
    "resume no RL run of that tag": (lambda base: rl_run_dir(base) and resolve_resume("d3"), "; available: d2"),
    "resume step not a number": (lambda base: rl_run_dir(base, {"model_000001.pt": b""}) and resolve_resume("d2:x"),
                                 "error: --resume=d2:x: the step after ':' must be a number"),
    "resume a step not saved": (lambda base: rl_run_dir(base, {"model_000001.pt": b""}) and resolve_resume("d2:7"),
                                "error: --resume=d2:7: run 'd2' has no step 7; saved steps: 1 (e.g. --resume=d2:1)"),
    "resume a run with no step": (lambda base: rl_run_dir(base) and resolve_resume("d2"),
                                  "has no saved step; start a new run with --overwrite"),
    "resume an unreadable step": (lambda base: unreadable(rl_run_dir(base, {"model_000001.pt": b"", "model_000002.pt": b""})),
                                  "error: --resume: a fault; resume another saved step (--resume=d2:1; saved: 1) or "
                                  "start a new run with --overwrite"),
    "resume the only step, unreadable": (lambda base: unreadable(rl_run_dir(base, {"model_000002.pt": b""})),
                                         "error: --resume: a fault; no other step of this run is saved: start a new run "
                                         "with --overwrite"),
    "another run in the output dir": (lambda base: raise_(RunExistsError(rl_run_dir(base), ["model_000001.pt"])),
                                      "already holds an RL run, step 1: 1 file (model_000001.pt); continue it with "
                                      "--resume, write the new run beside it with --output-tag=<new name>, or delete "
                                      "those files for good and start over with --overwrite"),
    "no start checkpoint for the KL penalty": (lambda base: load_reference(None, "cpu", None),
                                               "error: --kl-coef > 0 needs the checkpoint the run started from, and this "
                                               "run's meta does not record it (written before --kl-coef existed); resume it "
                                               "with its own flags or start a new run"),
    "non-finite steps": (lambda base: raise_(NonFiniteStepsError(2, "none saved yet")),
                         "error: 2 consecutive steps had a non-finite loss or gradient; stopping (last good checkpoint: "
                         "none saved yet); lower the learning rates or use --dtype=float32"),
    # chat_sft's, below its script (nanochat/sft/)
    "SFT: fewer conversations than a step": (lambda base: raise_(TooFewConversationsError("gsm8k", 12, 16, 1)),
                                             "error: --tasks=gsm8k has 12 train conversations, fewer than "
                                             "--examples-per-step (16) x --num-epochs (1); lower --examples-per-step or "
                                             "pass --num-steps"),
    "SFT: held-out task not generative": (lambda base: held_out_questions(SimpleNamespace(eval_type="categorical"),
                                                                          "mmlu", 4),
                                          "error: --stop-at-pass1 samples answers to the first task of --tasks, but "
                                          "'mmlu' is categorical, not generative; put a generative task (gsm8k, "
                                          "arithmetic) first in --tasks"),
    "SFT: every question held out": (lambda base: held_out_questions(Arithmetic(size=4), "arithmetic", 4),
                                     "error: --stop-check-questions (4) holds out every train question of 'arithmetic' "
                                     "(4); hold out fewer"),
    "SFT: a later step in the output dir": (lambda base: checkpoint_dir(base, {"model_000003.pt": b""}) and output_dir(
                                                Namespace(output_tag=None, stop_check_every=None),
                                                SimpleNamespace(n_layer=2), 2, None),
                                            "already holds model_000003.pt, a later step than the 2 this run will save, "
                                            "so `--source=sft` would keep loading that one; pass --output-tag=<new tag> "
                                            "or move it away"),
}


def rl_run_dir(base, files=()):
    """$base/chatrl_checkpoints/d2 holding `files` {name: bytes}."""
    return checkpoint_dir(base, files, family="chatrl_checkpoints")


def unreadable(directory):
    """A checkpoint fault while --resume reads step 2 of the run in `directory`."""
    with Resume("d2", 2, directory, {}).errors():
        raise CheckpointError("a fault", directory)


@pytest.mark.parametrize("name", CASES)
def test_library_error_holds_facts_and_the_line_adds_the_flag(name, tmp_path, monkeypatch, capsys):
    """The library's message names no flag or script; run_main's one line adds them."""
    for var in ("RANK", "WORLD_SIZE", "NANOCHAT_DEBUG"):
        monkeypatch.delenv(var, raising=False)

    def fresh_base_dir(name):
        base = tmp_path / name
        base.mkdir()
        monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
        return base

    call, ending = CASES[name]
    with pytest.raises(UserError) as e:
        call(fresh_base_dir("library"))
    assert "--" not in str(e.value) and "scripts." not in str(e.value), str(e.value)

    with pytest.raises(SystemExit) as exit_info:
        cli.run_main(lambda argv: call(fresh_base_dir("script")), [])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and err.rstrip("\n").endswith(ending), err


def test_long_error_comes_through_whole(capsys):
    """A one-line error is never cut (it used to end mid-word at 300 characters, losing the fix it named)."""
    message = " ".join(f"word{i:03d}" for i in range(71)) + " -- pass --the-fix"  # 514 characters
    assert len(message) > 500

    def main(argv):
        raise UserError(message)

    with pytest.raises(SystemExit) as e:
        cli.run_main(main, [])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("argv, env, expected", [
    (["--task=x", "--debug", "--num-steps", "3"], None, True),
    (["--num-steps", "-1", "pos"], None, False),
    (["--debugger"], None, False),   # another flag, not an abbreviation of --debug
    (["--debug=1"], None, False),    # malformed: the script's own parser reports it
    ([], "1", True),                 # NANOCHAT_DEBUG=1
])
def test_debug_is_read_through_the_flags_declaration(argv, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("NANOCHAT_DEBUG", raising=False)
    else:
        monkeypatch.setenv("NANOCHAT_DEBUG", env)
    assert cli.debug_requested(argv) is expected


def test_debug_reraises_and_the_scripts_parser_accepts_it(monkeypatch):
    monkeypatch.delenv("NANOCHAT_DEBUG", raising=False)

    def main(argv):
        args = cli.add_debug_flag(cli.ArgumentParser()).parse_args(argv)
        assert args.debug
        raise UserError("boom")

    with pytest.raises(UserError, match="boom"):
        cli.run_main(main, ["--debug"])
