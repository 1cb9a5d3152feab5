"""Faults during a save, across ranks and on resume (issue 25): a process killed (SIGKILL) in the middle of writing a
checkpoint, one rank of two killed or out of disk, SIGTERM delivered to both ranks by torchrun, and --keep-last.

The moment of a fault is made deterministic by tests/support/fault_run.py (chat_rl with torch.save / os.replace patched to
kill the process, or fail with ENOSPC, when it writes or renames one named file), never by a sleep. The faults of a
checkpoint read on --resume (a shard missing, truncated, of another step or run, another world size) are rows of
tests/support/bad_input_table.py, run by tests/scripts/test_bad_input.py; here the 2-rank one (rank 1's shard lost).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import start_ranks as launch_ranks
from helpers import PYTHONPATH, REPO, TINY_RL_FLAGS, assert_same_weights, make_sft_checkpoint, weights

from nanochat import report
from nanochat.checkpoints.loading import load_model
from nanochat.checkpoints.optimizer_shards import load_shard_for_resume
from nanochat.checkpoints.store import list_steps
from nanochat.cli import run_main
from scripts import chat_rl

FAULT_RUN = str(REPO / "tests" / "support" / "fault_run.py")
STEPS = ["--num-steps=4", "--save-every=1"]  # saves steps 1, 2, 3; the faults hit step 2's save
LAST_STEP = ["meta_000003.json", "model_000003.pt", "optim_000003_rank0.pt"]  # all that --keep-last=1 leaves


def rl_dir(base):
    return Path(base) / "chatrl_checkpoints" / "d2"


def digests(root):
    """{relative path: sha256} of every file under root, hidden temp files included."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in Path(root).rglob("*") if p.is_file()}


def env_for(base, **extra):
    return {**os.environ, "NANOCHAT_BASE_DIR": str(base), "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH,
            "PYTHONUNBUFFERED": "1", **extra}


def start_ranks(args, base, world_size=2):
    """`python *args` as `world_size` ranks of one gloo process group (torchrun's environment; the store they
    meet at is hosted here, as torchrun's agent hosts it)."""
    return launch_ranks(lambda rank: args, world_size, env_for(base))


def wait_all(procs, timeout=180):
    """[(returncode, stdout, stderr)] of every process; a process still running after `timeout` fails the test
    (a rank waiting forever for a dead one is the bug this catches)."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def assert_complete_step(base, step, world_size):
    """Step `step` is whole: its model loads, its meta records the world size, and every rank's shard passes
    --resume's checks (present, readable, this step, rank, world size and run)."""
    model, _, meta = load_model("rl", "cpu", "eval", model_tag="d2", step=step)
    assert meta["world_size"] == world_size and meta["run_id"]
    for rank in range(world_size):
        load_shard_for_resume(str(rl_dir(base)), step, "cpu", meta, world_size, rank=rank)
    return model


@pytest.fixture
def one_thread():
    """In-process runs compute with one thread, as the subprocesses do (OMP_NUM_THREADS=1), so weights compare
    bitwise across the two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def module_base(tmp_path_factory, tiny_tokenizer):
    """A base dir with the tiny tokenizer and the random SFT checkpoint (as conftest's `sft`), shared by a module's
    tests that copy it before they change anything."""
    base = tmp_path_factory.mktemp("faults") / "nanochat"
    tiny_tokenizer.save(base / "tokenizer")
    make_sft_checkpoint(base, tiny_tokenizer.get_vocab_size())
    return base


@pytest.fixture(scope="module")
def uninterrupted(module_base, tmp_path_factory):
    """The last model of the run the kill tests interrupt (STEPS, --keep-last=1), run in-process without a fault."""
    base = tmp_path_factory.mktemp("uninterrupted") / "nanochat"
    shutil.copytree(module_base, base)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        torch.set_num_threads(1)
        try:
            chat_rl.main(TINY_RL_FLAGS + STEPS + ["--keep-last=1"])
        finally:
            torch.set_num_threads(threads)
    assert sorted(p.name for p in rl_dir(base).iterdir()) == LAST_STEP
    return weights(rl_dir(base) / "model_000003.pt")


# every write of step 2's save, in its order (the shard, the meta, the model are each written and fsynced, then
# renamed in that order; then the directory is fsynced; then --keep-last=1 removes step 1, its model file first)
STAGED = ["optim_000002_rank0.pt", "meta_000002.json", "model_000002.pt"]
SAVE_POINTS = [f"write:{name}" for name in STAGED] + [f"fsync:{name}" for name in STAGED] + \
              [f"rename:{name}" for name in STAGED] + ["dirsync:model_000002.pt", "prune:meta_000001.json"]


def steps_left(point):
    """The steps a loader sees after a fault at `point`: step 2 exists once its model file is renamed and, pruned,
    step 1 ceases to exist once its model file is removed (before its meta)."""
    return {"dirsync": [1, 2], "prune": [2]}.get(point.split(":")[0], [1])


def assert_left_by_a_fault_at(base, point):
    """What a fault at `point` leaves: the latest complete step loads, whole; of a step 2 that never became
    visible, only the files renamed before the fault (never the model)."""
    steps = steps_left(point)
    assert list_steps(str(rl_dir(base))) == steps
    assert_complete_step(base, steps[-1], world_size=1)
    where, _, name = point.partition(":")
    if where in ("write", "fsync", "rename"):
        renamed = STAGED[:STAGED.index(name)] if where == "rename" else []
        assert sorted(n.name for n in rl_dir(base).iterdir() if "000002" in n.name and not n.name.startswith(".")) \
            == sorted(renamed)


def resume_and_compare(base, uninterrupted):
    """--resume (--keep-last=1 is the run's own: kept without the flag) ends with bitwise the weights of the run
    that was never interrupted, and leaves exactly the last step: no temp file, no orphan of an earlier step."""
    chat_rl.main(["--resume", "--device-type=cpu"])
    assert sorted(p.name for p in rl_dir(base).iterdir()) == LAST_STEP
    assert_same_weights(weights(rl_dir(base) / "model_000003.pt"), uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("point", SAVE_POINTS)
def test_sigkill_at_every_write_of_a_save_keeps_the_last_complete_checkpoint_and_resume_is_exact(
        point, module_base, uninterrupted, tmp_path, monkeypatch, one_thread):
    """SIGKILL (a lost node) at each write of step 2's save (tests/support/fault_run.py reaches the moment through the save
    itself): the last complete step stays the latest and loads, whole, although --keep-last=1 removes every earlier
    step after each save (it runs only once the new step is in place); a kill while pruning leaves step 2 and
    the rest of step 1, which no loader sees; --resume then ends with bitwise the weights of the uninterrupted run."""
    base = tmp_path / "nanochat"
    shutil.copytree(module_base, base)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    killed = subprocess.run([sys.executable, FAULT_RUN, f"kill:{point}", *TINY_RL_FLAGS, *STEPS, "--keep-last=1"],
                            cwd=REPO, env=env_for(base), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "Saved checkpoint to" in killed.stdout and "(step 1)" in killed.stdout
    assert_left_by_a_fault_at(base, point)
    if point.startswith(("write", "fsync")):  # the killed file's half (or whole) temp file is left, hidden
        assert any(p.name.startswith(f".{point.split(':')[1]}.tmp-") for p in rl_dir(base).iterdir())
    resume_and_compare(base, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("point", SAVE_POINTS)
def test_disk_full_at_every_write_of_a_save_is_one_line_and_resume_is_exact(point, module_base, uninterrupted, tmp_path,
                                                                          monkeypatch, capsys, one_thread):
    """ENOSPC at each write of step 2's save: the run exits 2 with one line naming the file and the error; every
    temp file is removed; the last complete step loads, whole; --resume ends with bitwise the uninterrupted run's
    weights. Two errors end nothing: the directory's fsync's (best effort, see files.fsync_dir), and the pruning's
    (EIO removing step 1's meta, after its model file: step 2 is saved; a warning names the file, the next prune
    retries it). Those runs go on and end with the uninterrupted run's weights."""
    import fault_run
    base = tmp_path / "nanochat"
    shutil.copytree(module_base, base)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    flags = TINY_RL_FLAGS + STEPS + ["--keep-last=1"]
    with monkeypatch.context() as patch:
        for module, name, value in fault_run.patches(f"enospc:{point}"):
            patch.setattr(module, name, value)
        if point.startswith(("dirsync", "prune")):
            chat_rl.main(flags)
        else:
            with pytest.raises(SystemExit) as e:
                run_main(chat_rl.main, flags)
    if point.startswith(("dirsync", "prune")):
        out = capsys.readouterr().out
        left = ["meta_000001.json", "optim_000001_rank0.pt"] if point.startswith("prune") else []  # retried, failed again
        assert sorted(p.name for p in rl_dir(base).iterdir()) == sorted(left + LAST_STEP)
        assert out.count("warning: --keep-last could not remove meta_000001.json (Input/output error)") == len(left)
        return assert_same_weights(weights(rl_dir(base) / "model_000003.pt"), uninterrupted)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert point.split(":")[1] in err and "No space left on device" in err
    assert not [p.name for p in rl_dir(base).iterdir() if p.name.startswith(".")]
    assert_left_by_a_fault_at(base, point)
    resume_and_compare(base, uninterrupted)


@pytest.mark.slow
def test_a_rank_killed_while_writing_its_shard_leaves_the_previous_checkpoint_complete(module_base, tmp_path,
                                                                                       monkeypatch):
    """Rank 1 of 2 dies (SIGKILL) with its step-2 shard half written: rank 0, waiting for every rank to have
    staged its files, stops with one line instead of hanging or publishing step 2 (model_000002.pt would then lack
    rank 1's shard), removes its own staged files, and step 1 is complete on both ranks; a 2-rank --resume then
    ends with bitwise the weights of an uninterrupted 2-rank run."""
    base, other = tmp_path / "nanochat", tmp_path / "other"
    shutil.copytree(module_base, base)
    shutil.copytree(module_base, other)
    uninterrupted = start_ranks(["-m", "scripts.chat_rl", *TINY_RL_FLAGS, *STEPS], other)
    (rank0, out0, err0), (rank1, _, err1) = wait_all(start_ranks(
        [FAULT_RUN, "kill-writing:optim_000002_rank1.pt", *TINY_RL_FLAGS, *STEPS], base))
    assert rank1 == -signal.SIGKILL, err1[-2000:]
    assert rank0 == 2 and "(step 1)" in out0 and err0.count("\n") == 1, err0[-2000:]
    assert err0.startswith("error: lost another rank while saving step 2") and "--resume" in err0, err0
    assert list_steps(str(rl_dir(base))) == [1]
    names = sorted(p.name for p in rl_dir(base).iterdir())
    assert [n for n in names if "000002" in n and not n.startswith(".optim_000002_rank1.pt.tmp-")] == []
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    assert_complete_step(base, 1, world_size=2)
    resumed = wait_all(start_ranks(["-m", "scripts.chat_rl", "--resume", "--device-type=cpu"], base))
    for code, _, err in resumed + wait_all(uninterrupted):
        assert code == 0, err[-3000:]
    assert list_steps(str(rl_dir(base))) == [1, 2, 3]
    assert_complete_step(base, 3, world_size=2)
    assert_same_weights(weights(rl_dir(base) / "model_000003.pt"), weights(rl_dir(other) / "model_000003.pt"))


@pytest.fixture(scope="module")
def disk_full_on_rank1(module_base, tmp_path_factory):
    """A 2-rank run whose step-2 save fills rank 1's disk halfway through its shard: (base, [(code, out, err)])."""
    base = tmp_path_factory.mktemp("disk_full") / "nanochat"
    shutil.copytree(module_base, base)
    return base, wait_all(start_ranks([FAULT_RUN, "disk-full:optim_000002_rank1.pt", *TINY_RL_FLAGS, *STEPS], base))


@pytest.mark.slow
def test_disk_full_on_one_rank_stops_every_rank_with_one_line(disk_full_on_rank1):
    """Every rank exits 2; rank 0 (the one that prints) says in one line what rank 1 hit; nothing of step 2 is
    left on either rank (staged files removed everywhere), and step 1 is complete."""
    base, ((code0, _, err0), (code1, _, err1)) = disk_full_on_rank1
    assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]
    assert err0.count("\n") == 1, err0
    assert err0.startswith("error: rank 1: could not write checkpoint optim_000002_rank1.pt"), err0
    assert "No space left on device" in err0 and "free space" in err0
    assert err1 == ""
    assert sorted(p.name for p in rl_dir(base).iterdir()) == [
        "meta_000001.json", "model_000001.pt", "optim_000001_rank0.pt", "optim_000001_rank1.pt"]


@pytest.mark.slow
def test_resume_with_one_ranks_shard_lost_is_one_line_and_touches_nothing(disk_full_on_rank1, tmp_path):
    """--resume on 2 ranks after rank 1's shard of the latest step was lost (its node's disk replaced): rank 1
    finds it missing, rank 0 reports it (the ranks compare their checks before either goes on), both exit 2,
    and no file changes."""
    base = tmp_path / "nanochat"
    shutil.copytree(disk_full_on_rank1[0], base)
    (rl_dir(base) / "optim_000001_rank1.pt").unlink()
    before = digests(base)
    resume = ["-m", "scripts.chat_rl", "--resume", "--device-type=cpu"]
    (code0, _, err0), (code1, _, err1) = wait_all(start_ranks(resume, base))
    assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]
    assert err0.count("\n") == 1 and err0.startswith("error: --resume: optimizer shard "), err0
    assert "optim_000001_rank1.pt is missing" in err0 and "--overwrite" in err0
    assert digests(base) == before


@pytest.mark.slow
def test_torchrun_sigterm_saves_one_consistent_checkpoint_and_resume_is_bitwise(module_base, tmp_path):
    """SIGTERM to torchrun, which forwards it to both ranks: they finish the step, agree to stop, save one
    checkpoint (the model, the meta and both shards of the same step and run) and exit; a 2-rank --resume then
    ends with bitwise the weights of an uninterrupted 2-rank run. The signal lands in step 0 by construction, not
    by a race: the ranks' rewards wait for a gate file (rl_toy_task.GatedParityTask) until rank 0 says it received
    the signal, so both are still inside step 0, before its stop check. (The uninterrupted run and the resume start their ranks without torchrun's agent, which
    only adds start-up time: the ranks compute the same.)"""
    flags = [f if not f.startswith("--task=") else "--task=rl_toy_task:GatedParityTask" for f in TINY_RL_FLAGS]
    flags += ["--num-steps=5", "--save-every=-1"]
    stopped, other = tmp_path / "stopped", tmp_path / "other"
    shutil.copytree(module_base, stopped)
    shutil.copytree(module_base, other)
    uninterrupted = start_ranks(["-m", "scripts.chat_rl", *flags], other)
    gate = tmp_path / "gate"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "scripts.chat_rl", "--", *flags], cwd=REPO, env=env_for(stopped, GATE_FILE=str(gate)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("rollouts: "):  # set up, before step 0's rewards
                proc.send_signal(signal.SIGTERM)
            if line.startswith("received SIGTERM: finishing this step"):  # rank 0 has it (the ranks agree by MAX)
                gate.touch()
                break
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    names = sorted(p.name for p in rl_dir(stopped).iterdir())
    assert len(names) == 4, (names, err[-3000:])
    step = int(names[0][5:11])
    assert names == [f"meta_{step:06d}.json", f"model_{step:06d}.pt", f"optim_{step:06d}_rank0.pt",
                     f"optim_{step:06d}_rank1.pt"] and step == 0
    assert f"Stopped after step {step} on request. Resume with: python -m scripts.chat_rl --resume=d2:{step}" in out
    meta = json.loads((rl_dir(stopped) / names[0]).read_text())
    shards = [torch.load(rl_dir(stopped) / n, weights_only=True) for n in names[2:]]
    assert [(s["step"], s["rank"], s["world_size"], s["run_id"]) for s in shards] == [
        (step, r, 2, meta["run_id"]) for r in range(2)]

    resumed = wait_all(start_ranks(["-m", "scripts.chat_rl", "--resume", "--device-type=cpu"], stopped))
    for code, _, err in resumed + wait_all(uninterrupted):
        assert code == 0, err[-3000:]
    assert_same_weights(weights(rl_dir(stopped) / "model_000004.pt"), weights(rl_dir(other) / "model_000004.pt"))


def test_keep_last_keeps_exactly_the_last_n_and_never_the_start_checkpoint(sft, base_dir, capsys):
    """--keep-last=2 over 6 saves leaves exactly the last 2 steps (model, meta, shard). A new run from it
    (--source=rl with --kl-coef, whose reference is the checkpoint it starts from) with --keep-last=1 leaves the
    run it read, and the SFT checkpoint, byte for byte as they were."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=7", "--save-every=1", "--keep-last=2"])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("--keep-last")] == [
        f"--keep-last=2: removed step {s}" for s in range(1, 5)]
    assert sorted(p.name for p in rl_dir(base_dir).iterdir()) == [
        "meta_000005.json", "meta_000006.json", "model_000005.pt", "model_000006.pt",
        "optim_000005_rank0.pt", "optim_000006_rank0.pt"]

    before = digests(base_dir / "chatrl_checkpoints" / "d2"), digests(base_dir / "chatsft_checkpoints")
    chat_rl.main(TINY_RL_FLAGS + ["--source=rl", "--model-tag=d2", "--kl-coef=0.1", "--num-steps=3", "--save-every=1",
                                  "--keep-last=1"])
    after = digests(base_dir / "chatrl_checkpoints" / "d2"), digests(base_dir / "chatsft_checkpoints")
    assert after == before
    assert sorted(p.name for p in (base_dir / "chatrl_checkpoints" / "d2_cont").iterdir()) == [
        "meta_000002.json", "model_000002.pt", "optim_000002_rank0.pt"]


def test_steps_that_train_nothing_log_no_entropy(sft, base_dir, monkeypatch, capsys):
    """Regression: a step with no trained row (every question no-signal) logged `entropy nan` to the console,
    the history and wandb, and would chart as NaN. Now such a step has no entropy value anywhere; the report's
    entropy plot draws the steps that have one."""
    from rl_toy_task import ParityTask
    real_reward = ParityTask.reward
    # questions 0-3 make step 0 (examples-per-step=4): mixed rewards; every other question is always wrong
    monkeypatch.setattr(ParityTask, "reward", lambda self, conversation, text: real_reward(self, conversation, text)
                        if int(conversation["messages"][0]["content"].split()[-1]) < 4 else 0.0)
    logged = []

    class Recorder:
        def log(self, data, **kwargs):
            logged.append(data)

        def finish(self):
            pass
    monkeypatch.setattr(chat_rl, "init_wandb", lambda *args, **kwargs: Recorder())
    plotted = {}
    real_plot = report._plot

    def plot(path, ylabel, series, **kwargs):
        plotted[os.path.basename(path)] = series
        return real_plot(path, ylabel, series, **kwargs)
    monkeypatch.setattr(report, "_plot", plot)
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Step ")]
    meta_text = (rl_dir(base_dir) / "meta_000001.json").read_text()
    history = json.loads(meta_text, parse_constant=lambda c: pytest.fail(f"{c} in the saved history"))["history"]
    assert [h["rows_trained"] > 0 for h in history] == [True, False]
    assert "Entropy: " in lines[0] and "Entropy" not in lines[1] and "nan" not in lines[1]
    assert history[0]["entropy"] > 0 and "entropy" not in history[1]
    steps = [d for d in logged if "reward" in d]
    assert [("entropy" in d) for d in steps] == [True, False]
    assert all(v == v for d in steps for v in d.values() if isinstance(v, float))  # no NaN logged
    (xs, ys, _), = plotted["chat-rl-entropy.png"]
    assert xs == [0] and ys == [history[0]["entropy"]]
    assert "nan" not in (base_dir / "report" / "chat-rl.md").read_text()
