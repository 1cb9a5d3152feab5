"""
What chat_rl says when its input is bad: one row per case, run as a real subprocess in a fresh base dir.

Every case starts from a tiny valid setup (a 400-token tokenizer and a 2-layer SFT checkpoint in a temporary
$NANOCHAT_BASE_DIR), breaks one thing (a missing file, a corrupted checkpoint, a bad flag, a full disk...),
runs `python -m scripts.chat_rl` and records the exit code and what stderr showed. A good answer is exit
code 2 and one line naming the problem and the fix. Prints a markdown table ($BASE = the temporary base dir).

The cases and the base-dir builder are also what tests/scripts/test_bad_input.py runs (in-process), so the
table and the tests cover the same ground.

Launch (from the repo root; about a minute on a CPU):
  python tests/support/bad_input_table.py
"""

import atexit
import contextlib
import errno
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from helpers import PYTHONPATH, REPO, make_sft_checkpoint

from nanochat.cli import ArgumentParser, run_main
from nanochat.tokenizer import Tokenizer

TOKENIZER_VOCAB = 400
SFT_DIR = Path("chatsft_checkpoints") / "d2"
SFT_MODEL = SFT_DIR / "model_000000.pt"
RL_DIR = Path("chatrl_checkpoints") / "d2"
# a run that finishes in seconds on a CPU; cases add their own flags after these
TINY_FLAGS = ["--task=arithmetic", "--device-type=cpu", "--dtype=float32", "--examples-per-step=2", "--num-samples=2",
              "--device-batch-size=2", "--max-new-tokens=8", "--eval-every=-1", "--num-steps=1"]


# -----------------------------------------------------------------------------
# the valid starting point

def tokenizer_corpus(n=200):
    """Deterministic text with enough repeated pairs for a 400-token BPE: words, numbers, tool calls."""
    rng = random.Random(0)
    words = ["apples", "marbles", "bags", "each", "has", "gives", "away", "how", "many", "left", "the", "She", "He",
             "buys", "more", "total", "of", "in", "and", "with", "#### ", "<<", ">>", "=", "+", "-", "*", "/"]
    return [" ".join(rng.choice(words) if rng.random() < 0.7 else str(rng.randint(0, 999)) for _ in range(40))
            for _ in range(n)]


def build_base_dir(base, model_vocab_size=None):
    """Write a tiny tokenizer and a tiny random SFT checkpoint (chatsft_checkpoints/d2, step 0) under `base`.
    model_vocab_size: the model's vocab (default: the tokenizer's)."""
    base = Path(base)
    tokenizer = Tokenizer.train_from_iterator(iter(tokenizer_corpus()), TOKENIZER_VOCAB)
    tokenizer.save(str(base / "tokenizer"))
    write_sft_checkpoint(base, model_vocab_size or tokenizer.get_vocab_size())
    return base


def write_sft_checkpoint(base, vocab_size):
    """An untrained (init_weights) 2-layer model saved where chat_rl looks for an SFT checkpoint (SFT_DIR)."""
    make_sft_checkpoint(base, vocab_size, noise=0, sequence_len=64)


_SAVED_RUNS = {}


def saved_rl_runs():
    """A base dir as build_base_dir's, holding two RL runs of TINY_FLAGS with --num-steps=4 --save-every=1, as if
    stopped after step 2 (steps 1 and 2 saved, step 3's files removed: a step left for --resume to train, where it
    reads the optimizer shards): chatrl_checkpoints/d2 and chatrl_checkpoints/other. Built once per process
    (in-process runs, a few seconds in all) and removed at exit; the --resume cases copy from it."""
    if "base" not in _SAVED_RUNS:
        from scripts import chat_rl
        root = tempfile.mkdtemp(prefix="bad-input-rl-")
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        base = build_base_dir(Path(root) / "nanochat")
        previous = os.environ.get("NANOCHAT_BASE_DIR")
        os.environ["NANOCHAT_BASE_DIR"] = str(base)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                for tag in ("d2", "other"):
                    chat_rl.main(TINY_FLAGS + ["--num-steps=4", "--save-every=1", f"--output-tag={tag}"])
                    for f in (base / "chatrl_checkpoints" / tag).glob("*_000003*"):
                        f.unlink()
        finally:
            if previous is None:
                os.environ.pop("NANOCHAT_BASE_DIR")
            else:
                os.environ["NANOCHAT_BASE_DIR"] = previous
        _SAVED_RUNS["base"] = base
    return _SAVED_RUNS["base"]


# -----------------------------------------------------------------------------
# the cases: each breaks one thing in a valid base dir

@dataclass
class Case:
    name: str
    flags: list = field(default_factory=list)           # appended to TINY_FLAGS
    setup: Optional[Callable] = None                    # setup(base) -> {env var: value, or None to unset}
    full_disk_at_step: Optional[int] = None             # the checkpoint save of this step hits a full disk


def _missing_base_dir(base):
    return {"NANOCHAT_BASE_DIR": str(base / "does-not-exist")}


def _no_checkpoint(base):
    for f in (base / SFT_DIR).iterdir():
        f.unlink()
    return {}


def _no_tokenizer(base):
    for f in (base / "tokenizer").iterdir():
        f.unlink()
    (base / "tokenizer").rmdir()
    return {}


def _vocab_mismatch(base):
    write_sft_checkpoint(base, 512)  # the tokenizer has 400 tokens
    return {}


def _teacher_of_another_tokenizer(base):
    """A teacher checkpoint (chatsft_checkpoints/t3) whose model was trained with a 512-token tokenizer."""
    make_sft_checkpoint(base, 512, noise=0, sequence_len=64, tag="t3")
    return {}


def _teacher_in_the_runs_directory(base):
    """The SFT checkpoint copied as an RL run's (chatrl_checkpoints/d2): a new run from sft:d2 writes there too."""
    shutil.copytree(base / SFT_DIR, base / "chatrl_checkpoints" / "d2")
    return {}


def _truncated_checkpoint(base):
    path = base / SFT_MODEL
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return {}


def _garbage_checkpoint(base):
    (base / SFT_MODEL).write_bytes(random.Random(0).randbytes(4096))
    return {}


def _corrupted_meta(base):
    (base / SFT_DIR / "meta_000000.json").write_text('{"model_config": {"vocab_size": 4', encoding="utf-8")
    return {}


def _gsm8k_offline(base):
    return {"NANOCHAT_GSM8K_DIR": None, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(base / "empty-hf-home")}


def _output_dir_is_a_file(base):
    (base / "chatrl_checkpoints").write_text("a file where the RL checkpoint directory should be\n")
    return {}


def _report_dir_is_a_file(base):
    (base / "report").write_text("a file where the report folder should be\n")
    return {}


def _existing_rl_run(base):
    rl = base / "chatrl_checkpoints" / "d2"
    rl.mkdir(parents=True)
    for f in (base / SFT_DIR).iterdir():
        (rl / f.name).write_bytes(f.read_bytes())
    return {}


def _empty_base_dir(base):
    empty = base / "empty-base-dir"
    empty.mkdir()
    return {"NANOCHAT_BASE_DIR": str(empty)}


def _rl_run(base):
    """A copy of saved_rl_runs()'s run d2 (steps 1 and 2) in `base`; returns its directory."""
    shutil.copytree(saved_rl_runs() / RL_DIR, base / RL_DIR)
    return base / RL_DIR


def _saved_rl_run(base):
    _rl_run(base)
    return {}


def _shard_missing(base):
    (_rl_run(base) / "optim_000002_rank0.pt").unlink()
    return {}


def _halved(path):
    """The file cut to its first half, as a write stopped midway leaves it."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return {}


def _shard_truncated(base):
    return _halved(_rl_run(base) / "optim_000002_rank0.pt")


def _shard_of_another_step(base):
    run = _rl_run(base)
    shutil.copyfile(run / "optim_000001_rank0.pt", run / "optim_000002_rank0.pt")
    return {}


def _shard_of_another_run(base):
    shutil.copyfile(saved_rl_runs() / "chatrl_checkpoints" / "other" / "optim_000002_rank0.pt",
                    _rl_run(base) / "optim_000002_rank0.pt")
    return {}


def _saved_by_two_ranks(base):
    run = _rl_run(base)
    meta = json.loads((run / "meta_000002.json").read_text())
    (run / "meta_000002.json").write_text(json.dumps({**meta, "world_size": 2}))
    shutil.copyfile(run / "optim_000002_rank0.pt", run / "optim_000002_rank1.pt")
    return {}


def _resumed_model_truncated(base):
    return _halved(_rl_run(base) / "model_000002.pt")


def _no_interpreter_and_no_checkpoint(base):
    """A CPU without Triton's interpreter, and nothing to load: a refusal that names the flag came before the load."""
    return {"TRITON_INTERPRET": "0", **_empty_base_dir(base)}


def _three_ranks(base):
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}


CASES = [
    Case("base dir does not exist", setup=_missing_base_dir),
    Case("no checkpoint in the model dir", setup=_no_checkpoint),
    Case("tokenizer missing", setup=_no_tokenizer),
    Case("model and tokenizer vocab differ", setup=_vocab_mismatch),
    Case("checkpoint truncated", setup=_truncated_checkpoint),
    Case("checkpoint is random bytes", setup=_garbage_checkpoint),
    Case("checkpoint meta is cut-off json", setup=_corrupted_meta),
    Case("GSM8K not available offline", flags=["--task=gsm8k"], setup=_gsm8k_offline),
    Case("--num-samples not a multiple of --device-batch-size", flags=["--num-samples=3", "--device-batch-size=2"]),
    Case("--resume together with --overwrite", flags=["--resume", "--overwrite"]),
    Case("--resume with no RL run to resume", flags=["--resume"]),
    Case("--resume: the optimizer shard is missing", flags=["--resume"], setup=_shard_missing),
    Case("--resume: the optimizer shard is truncated", flags=["--resume"], setup=_shard_truncated),
    Case("--resume: the optimizer shard is another step's", flags=["--resume"], setup=_shard_of_another_step),
    Case("--resume: the optimizer shard is another run's", flags=["--resume"], setup=_shard_of_another_run),
    Case("--resume: the meta says 2 ranks, the shards 1", flags=["--resume"], setup=_saved_by_two_ranks),
    Case("--resume: the model file is truncated", flags=["--resume"], setup=_resumed_model_truncated),
    Case("negative --keep-last", flags=["--keep-last=-1"]),
    Case("negative --temperature", flags=["--temperature=-1"]),
    Case("--max-new-tokens=0", flags=["--max-new-tokens=0"]),
    Case("--init-lr-frac out of range", flags=["--init-lr-frac=2"]),
    Case("unknown --device-type", flags=["--device-type=tpu"]),
    Case("unknown --source", flags=["--source=pretrain"]),
    Case("--source=rl writing into the run it reads", flags=["--source=rl", "--model-tag=d2", "--output-tag=d2"]),
    Case("--num-steps not a number", flags=["--num-steps=abc"]),
    Case("misspelled flag", flags=["--num-stpes=3"]),
    Case("unknown --model-tag", flags=["--model-tag=d99"]),
    Case("unknown --model-step", flags=["--model-step=7"]),
    Case("output dir blocked by a file", setup=_output_dir_is_a_file),
    Case("an RL run already in the output dir", setup=_existing_rl_run),
    Case("report folder blocked by a file", setup=_report_dir_is_a_file),
    Case("--resume asks for more steps than the run planned", flags=["--resume", "--num-steps=5"], setup=_saved_rl_run),
    Case("disk full while saving a checkpoint", flags=["--num-steps=3", "--save-every=1"], full_disk_at_step=2),
    Case("3 ranks do not divide --examples-per-step=2", setup=_three_ranks),
    Case("task does not exist", flags=["--task=nosuchtask"]),
    Case("task does not exist, and no checkpoint either", flags=["--task=nosuchtask"], setup=_empty_base_dir),
    Case("task class does not exist", flags=["--task=tasks.gsm8k:NoSuchClass"]),
    Case("--decode-kernels not a choice", flags=["--decode-kernels=fast"]),
    Case("--decode-kernels=triton on a CPU without Triton's interpreter", flags=["--decode-kernels=triton"],
         setup=_no_interpreter_and_no_checkpoint),
    Case("--decode-kernels=triton with --compile=on", flags=["--decode-kernels=triton", "--compile=on"],
         setup=_empty_base_dir),
    Case("--teacher trained with another tokenizer", flags=["--model-tag=d2", "--teacher=sft:t3", "--distill-coef=1"],
         setup=_teacher_of_another_tokenizer),
    Case("--teacher in the directory the new run writes (with --overwrite it would be deleted)",
         flags=["--model-tag=d2", "--teacher=rl:d2", "--distill-coef=1", "--overwrite"],
         setup=_teacher_in_the_runs_directory),
]


# -----------------------------------------------------------------------------
# running a case

def full_disk_save(real_save, step, on_fail=None):
    """A torch.save that behaves like a disk filling up while step `step`'s model file is written: some
    bytes land, then OSError(ENOSPC). on_fail() runs just before the error (tests snapshot files there)."""
    def save(obj, f, *args, **kwargs):
        name = os.path.basename(str(getattr(f, "name", f)))
        if f"model_{step:06d}.pt" in name:
            f.write(b"PK\x03\x04 half a checkpoint")
            if on_fail is not None:
                on_fail()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return real_save(obj, f, *args, **kwargs)
    return save


def _full_disk_child():
    """Entry of the full-disk subprocess: argv = step, then chat_rl's flags."""
    from scripts import chat_rl
    torch.save = full_disk_save(torch.save, int(sys.argv[1]))
    run_main(chat_rl.main, sys.argv[2:])


def case_env(case, base):
    """The environment a case runs in: this process's, with the base dir and the case's overrides."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base), "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NANOCHAT_DEBUG"):
        env.pop(var, None)
    for var, value in (case.setup(base) if case.setup else {}).items():
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    return env


def run_case(case, root, extra_flags=(), timeout=300):
    """Build a base dir under `root`, break it as the case says, and run chat_rl in a subprocess.
    Returns the CompletedProcess (a timeout counts as a failure, not an exception)."""
    base = build_base_dir(Path(root) / "nanochat")
    env = case_env(case, base)
    flags = TINY_FLAGS + case.flags + list(extra_flags)
    if case.full_disk_at_step is None:
        cmd = [sys.executable, "-m", "scripts.chat_rl", *flags]
    else:
        cmd = [sys.executable, "-c", "from bad_input_table import _full_disk_child; _full_disk_child()",
               str(case.full_disk_at_step), *flags]
    try:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, returncode=None, stdout=e.stdout or "", stderr=f"(no exit after {timeout} s)")


def shown_message(stderr):
    """The table cell for stderr: its one line, or a summary when it has several."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if len(lines) == 1:
        return lines[0]
    if not lines:
        return "(nothing on stderr)"
    traceback = " with a traceback" if any(line.startswith("Traceback") for line in lines) else ""
    return f"({len(lines)} lines{traceback}; last: {lines[-1]})"


def main(argv=None):
    p = ArgumentParser(description="print a markdown table of chat_rl's answers to bad input")
    p.add_argument("--only", type=str, default="", help="run only cases whose name contains this text")
    args = p.parse_args(argv)
    cases = [c for c in CASES if args.only in c.name]
    rows = [("case", "exit code", "message shown (stderr)")]
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="bad-input-") as root:
            result = run_case(case, root)
        rows.append((case.name, "timeout" if result.returncode is None else str(result.returncode),
                     shown_message(result.stderr.replace(str(Path(root) / "nanochat"), "$BASE"))))
        print(f"ran: {case.name}", file=sys.stderr, flush=True)
    # --debug on one case: the full traceback instead of the one line
    debug_case = CASES[1]
    with tempfile.TemporaryDirectory(prefix="bad-input-") as root:
        result = run_case(debug_case, root, extra_flags=["--debug"])
    rows.append((f"{debug_case.name}, with --debug", str(result.returncode),
                 shown_message(result.stderr.replace(str(Path(root) / "nanochat"), "$BASE"))))
    escape = lambda s: s.replace("|", "\\|").replace("\n", " ")
    print("\n".join("| " + " | ".join(escape(c) for c in row) + " |" + ("\n|---|---|---|" if i == 0 else "")
                    for i, row in enumerate(rows)))


if __name__ == "__main__":
    main()
