"""chat_rl on bad input: exit code 2, one line on stderr that names the problem and the fix, no traceback
(unless --debug), and no partial checkpoint files left behind.

The cases are tests/support/bad_input_table.py's (the table in the closing note shows the same runs). Most run
in-process through `run_main(chat_rl.main, argv)`; a few run as real subprocesses to check the process
exit code and the raw stderr.
"""

import hashlib
from pathlib import Path

import pytest
import torch
from bad_input_table import CASES, TINY_FLAGS, build_base_dir, full_disk_save, run_case

from nanochat.cli import run_main
from nanochat.errors import UserError
from scripts import chat_rl

# what each case's line must say: the problem and the fix (substrings)
EXPECTED = {
    "base dir does not exist": ["does-not-exist", "NANOCHAT_BASE_DIR"],
    "no checkpoint in the model dir": ["no model_<step>.pt files in", "chatsft_checkpoints/d2", "--model-tag"],
    "tokenizer missing": ["no tokenizer at", "tokenizer.pkl", "scripts.tok_train"],
    "model and tokenizer vocab differ": ["vocab size 400", "512", "tokenizer"],
    "--teacher trained with another tokenizer": ["teacher sft:t3:0", "(vocab 512)", "student sft:d2:0 (vocab 400)",
                                                 "must share the student's tokenizer"],
    "--teacher in the directory the new run writes (with --overwrite it would be deleted)": [
        "the teacher's checkpoints are in", "chatrl_checkpoints/d2", "--output-tag=<new name>"],
    "checkpoint truncated": ["model_000000.pt", "truncated", "--model-step"],
    "checkpoint is random bytes": ["model_000000.pt", "corrupted", "--model-step"],
    "checkpoint meta is cut-off json": ["meta_000000.json", "not valid json", "--model-step"],
    "GSM8K not available offline": ["GSM8K", "NANOCHAT_GSM8K_DIR", "prepare_gsm8k"],
    "--num-samples not a multiple of --device-batch-size": [
        "--num-samples (3) must be a multiple of --device-batch-size (2)", "--device-batch-size=1"],
    "--resume together with --overwrite": ["--resume", "--overwrite", "pass only one"],
    "--resume with no RL run to resume": ["no RL run in", "without --resume"],
    "--resume: the optimizer shard is missing": ["optim_000002_rank0.pt is missing", "--resume=d2:1", "--overwrite"],
    "--resume: the optimizer shard is truncated": ["optim_000002_rank0.pt is corrupted or truncated", "--resume=d2:1"],
    "--resume: the optimizer shard is another step's": ["optim_000002_rank0.pt holds step 1, not step 2",
                                                        "--resume=d2:1"],
    "--resume: the optimizer shard is another run's": ["optim_000002_rank0.pt is from another run", "--resume=d2:1"],
    "--resume: the meta says 2 ranks, the shards 1": [
        "optim_000002_rank0.pt was written by rank 0 of 1 ranks, not by rank 0 of 2", "--resume=d2:1"],
    "--resume: the model file is truncated": ["model_000002.pt is corrupted or truncated", "--resume=d2:1"],
    "negative --keep-last": ["--keep-last must be >= 0", "-1"],
    "negative --temperature": ["--temperature must be >= 0", "-1"],
    "--max-new-tokens=0": ["--max-new-tokens must be >= 1", "got 0"],
    "--init-lr-frac out of range": ["--init-lr-frac must be in (0, 1]", "2.0"],
    "unknown --device-type": ["'tpu'", "cpu"],
    "unknown --source": ["--source must be base, mid, sft, rl", "'pretrain'"],
    "--source=rl writing into the run it reads": ["--output-tag=d2 is the RL run --source=rl reads", "--resume=d2"],
    "--num-steps not a number": ["--num-steps", "'abc'"],
    "misspelled flag": ["--num-stpes"],
    "unknown --model-tag": ["'d99'", "available tags: d2"],
    "unknown --model-step": ["no step 7", "available steps: 0"],
    "output dir blocked by a file": ["cannot write the run's checkpoints to", "chatrl_checkpoints/d2: Not a directory (",
                                     "chatrl_checkpoints is a file)", "NANOCHAT_BASE_DIR"],
    "an RL run already in the output dir": [  # the flag that writes elsewhere, and what --overwrite would delete
        "already holds an RL run, step 0: 2 files (meta_000000.json, model_000000.pt); continue it with --resume, write "
        "the new run beside it with --output-tag=<new name>, or delete those files for good and start over with "
        "--overwrite"],
    "report folder blocked by a file": ["cannot write the run's report to", "report: it is a file, not a folder",
                                        "NANOCHAT_BASE_DIR"],
    "--resume asks for more steps than the run planned": [
        "error: --num-steps=5: run d2 was planned with 4 steps, over which its learning rate decays "
        "(--lr-schedule=linear), and --resume continues it to that end, not further; to train it further, start a new "
        "run from its last checkpoint: python -m scripts.chat_rl --source=rl --model-tag=d2 --device-type=cpu "
        "--dtype=float32 --rollout-dtype=float32 --task=arithmetic --device-batch-size=2 --examples-per-step=2 "
        "--num-samples=2 --max-new-tokens=8 --eval-every=-1 --save-every=1 --num-steps=5 (a new run, written to "
        "d2_cont)"],
    "disk full while saving a checkpoint": ["model_000002.pt", "No space left on device",
                                            "the checkpoint of step 1 was kept (--resume=d2:1 continues from it)",
                                            "free space"],
    "3 ranks do not divide --examples-per-step=2": [
        "--examples-per-step (2) must be divisible by the number of ranks (3)", "multiple of 3"],
    "task does not exist": ["unknown task 'nosuchtask'", "package.module:ClassName"],
    "task does not exist, and no checkpoint either": ["unknown task 'nosuchtask'"],  # the flag, before any loading
    "task class does not exist": ["'NoSuchClass'", "--task"],
    "--decode-kernels not a choice": ["argument --decode-kernels: invalid choice: 'fast'"],
    # the flag's line, not the empty base dir's: refused before anything loads (where triton is not installed, the
    # line says so instead of naming the interpreter)
    "--decode-kernels=triton on a CPU without Triton's interpreter": [
        "--decode-kernels is triton: the Triton kernels ", "use --decode-kernels=auto or torch"],
    "--decode-kernels=triton with --compile=on": ["--decode-kernels is triton, whose step is never compiled",
                                                  "--compile=off or auto"],
}
BY_NAME = {case.name: case for case in CASES}
# run as subprocesses only: a regression in the rank check would make an in-process run wait for ranks that never come
SUBPROCESS_ONLY = {"3 ranks do not divide --examples-per-step=2"}
FULL_DISK = "disk full while saving a checkpoint"
IN_PROCESS = [c for c in CASES if c.name not in SUBPROCESS_ONLY and c.name != FULL_DISK]


def digests(root):
    return {f: hashlib.sha256((Path(root) / f).read_bytes()).hexdigest() for f in files_under(root)}


def files_under(root):
    return {str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file()} if Path(root).exists() else set()


def assert_one_line_error(code, err, fragments):
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def assert_no_partial_files(before, after):
    new = sorted(after - before)
    assert not [f for f in after if ".tmp" in f], new
    assert new == [], new


@pytest.fixture
def base(tmp_path, monkeypatch):
    """A valid base dir (tiny tokenizer + SFT checkpoint), as the environment of an in-process run."""
    base = build_base_dir(tmp_path / "nanochat")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NANOCHAT_DEBUG", "NANOCHAT_GSM8K_DIR"):
        monkeypatch.delenv(var, raising=False)
    return base


def apply_case(case, base, monkeypatch):
    for var, value in (case.setup(base) if case.setup else {}).items():
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)


def test_every_case_has_an_expectation():
    assert set(EXPECTED) == set(BY_NAME)


@pytest.mark.parametrize("case", IN_PROCESS, ids=[c.name for c in IN_PROCESS])
def test_bad_input_is_one_line_and_exit_2(case, base, monkeypatch, capsys):
    """...and every file as it was: none added, removed or changed (the --resume cases check a checkpoint before
    anything of it is trusted or overwritten)."""
    apply_case(case, base, monkeypatch)
    before = files_under(base)
    contents = digests(base)
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_FLAGS + case.flags)
    assert_one_line_error(e.value.code, capsys.readouterr().err, EXPECTED[case.name])
    assert_no_partial_files(before, files_under(base))
    assert digests(base) == contents
    if case.name == "base dir does not exist":
        assert not (base / "does-not-exist").exists()  # a mistyped base dir is not created as a side effect


def test_full_disk_during_save_leaves_earlier_checkpoints_intact(base, monkeypatch, capsys):
    """The step-2 save hits ENOSPC halfway through the model file: one line, exit 2, no temp file, no step-2
    file, and step 1 (saved before) byte-identical and loadable."""
    case = BY_NAME[FULL_DISK]
    rl_dir = base / "chatrl_checkpoints" / "d2"
    at_failure = {}

    def snapshot():
        at_failure.update({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in rl_dir.glob("*_000001*")})

    monkeypatch.setattr(torch, "save", full_disk_save(torch.save, case.full_disk_at_step, on_fail=snapshot))
    before = files_under(base)
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_FLAGS + case.flags)
    assert_one_line_error(e.value.code, capsys.readouterr().err, EXPECTED[case.name])
    new = files_under(base) - before
    step1 = {"model_000001.pt", "meta_000001.json", "optim_000001_rank0.pt"}
    assert new == {f"chatrl_checkpoints/d2/{name}" for name in step1}  # nothing of step 2, no temp files
    assert set(at_failure) == step1
    for name, digest in at_failure.items():
        assert hashlib.sha256((rl_dir / name).read_bytes()).hexdigest() == digest, name
    state = torch.load(rl_dir / "model_000001.pt", weights_only=True)
    assert "lm_head.weight" in state


def test_debug_shows_the_traceback(base, monkeypatch):
    apply_case(BY_NAME["no checkpoint in the model dir"], base, monkeypatch)
    with pytest.raises(UserError, match="no model_<step>.pt files"):
        run_main(chat_rl.main, TINY_FLAGS + ["--debug"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["3 ranks do not divide --examples-per-step=2", "base dir does not exist",
                                  "--decode-kernels=triton on a CPU without Triton's interpreter"])
def test_real_process_exits_2_with_one_line(name, tmp_path):
    """The real `python -m scripts.chat_rl`: exit status 2 and exactly one stderr line. With RANK/WORLD_SIZE
    set, the flag check comes before the process group (which would wait for the missing ranks)."""
    result = run_case(BY_NAME[name], tmp_path, timeout=120)
    assert_one_line_error(result.returncode, result.stderr, EXPECTED[name])
    assert not [f for f in files_under(tmp_path) if ".tmp" in f or "chatrl_checkpoints" in f]


def test_real_process_with_debug_prints_a_traceback(tmp_path):
    result = run_case(BY_NAME["no checkpoint in the model dir"], tmp_path, extra_flags=["--debug"], timeout=120)
    assert result.returncode not in (0, 2)
    assert "Traceback (most recent call last)" in result.stderr and "NoStepsError: no model_<step>.pt files" in result.stderr
