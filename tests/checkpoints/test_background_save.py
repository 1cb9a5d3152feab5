"""Saves written by a thread (nanochat/checkpoints/background.py): the files a synchronous save writes, of the
tensors as they were when the save began; nothing of the step visible until the commit; a failed write raised at
the commit with its temp files gone and the previous step untouched; the next save commits the last one first."""

import errno
import os
import threading

import pytest
import torch

from nanochat.checkpoints import store
from nanochat.checkpoints.background import BackgroundSaver, host_copy
from nanochat.checkpoints.store import list_steps, load_checkpoint, save_checkpoint
from nanochat.errors import UserError


def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g, dtype=torch.float64),
            "n": torch.tensor(7)}


def optimizer_shard(seed):
    g = torch.Generator().manual_seed(seed + 100)
    return {"optimizers": [{"state": {0: {"momentum_buffer": torch.randn(4, 3, generator=g)}},
                            "param_groups": [{"lr": 0.02, "params": [0]}]}], "rank": 0, "step": seed}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_host_copy_is_fixed_at_the_call_and_reuses_fitting_buffers():
    data = {"model": state(0), "shards": [optimizer_shard(0)], "note": "x"}
    copied, buffers = host_copy(data)
    assert same(copied, data) and len(buffers) == 4
    data["model"]["w"].add_(1.0)  # training goes on changing the originals
    assert not torch.equal(copied["model"]["w"], data["model"]["w"])
    again, reused = host_copy(data, buffers)
    assert same(again, data)
    assert [t.data_ptr() for t in reused] == [t.data_ptr() for t in buffers]  # written over, not allocated
    module_state = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict with the modules' versions, as torch.save writes
    assert host_copy(module_state)[0]._metadata == module_state._metadata
    other = {"model": {**state(0), "w": torch.zeros(5, 3)}, "shards": [optimizer_shard(0)], "note": "x"}
    _, mixed = host_copy(other, buffers)
    assert mixed[0].data_ptr() != buffers[0].data_ptr() and mixed[1].data_ptr() == buffers[1].data_ptr()


def test_host_copy_keeps_each_tensors_dtype_when_a_buffer_has_another():
    """A buffer of the last snapshot is written over only by a tensor of its shape and dtype: copied into a buffer of
    another dtype, a tensor would be saved cast (an fp64 or bf16 tensor where an fp32 one of its shape was)."""
    _, buffers = host_copy({"w": torch.randn(4, 3)})
    values = torch.randn(4, 3, dtype=torch.float64)
    again, reused = host_copy({"w": values}, buffers)
    assert again["w"].dtype == torch.float64 and torch.equal(again["w"], values)
    assert reused[0].data_ptr() != buffers[0].data_ptr()


def test_the_files_are_a_synchronous_saves_of_the_tensors_when_the_save_began(tmp_path):
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    model, shard, meta = state(1), optimizer_shard(1), {"step": 3, "history": [{"reward": 0.5}]}
    save_checkpoint(str(sync_dir), 3, model, shard, meta)
    saver, committed = BackgroundSaver(), []
    saver.start(str(async_dir), 3, model, shard, meta, after_commit=lambda: committed.append(list_steps(async_dir)))
    model["w"].mul_(-1)  # after the snapshot: not in the files
    meta["history"].append({"reward": 1.0})
    saver.finish()
    assert committed == [[3]] and not saver.pending
    assert sorted(os.listdir(sync_dir)) == sorted(os.listdir(async_dir))
    for got, want in zip(load_checkpoint(str(async_dir), 3, "cpu", load_optimizer=True, rank=0),
                         load_checkpoint(str(sync_dir), 3, "cpu", load_optimizer=True, rank=0)):
        assert same(got, want)


def test_the_snapshot_holds_nothing_the_run_changes_after_the_save_began(tmp_path, monkeypatch):
    """Every part of the snapshot compared with the run's state after the run moved on, the writer held until then
    (issue 67: a snapshot keeping a reference to something the live run changes afterwards passed this file, whose
    other test races the writer): the model's and the optimizer's tensors changed in place, the meta's history
    appended to and one of its records changed, a new meta key: the files hold the state at the start."""
    from nanochat.checkpoints import background
    release, real_stage_save = threading.Event(), background.stage_save

    def held_stage_save(*args, **kwargs):  # the writer starts (the meta encoded, the files written) only when released
        release.wait(timeout=30)
        return real_stage_save(*args, **kwargs)
    model, shard = state(3), optimizer_shard(3)
    meta = {"step": 4, "history": [{"reward": 0.5}], "user_config": {"lr": 0.1}}
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    save_checkpoint(str(sync_dir), 4, model, shard, meta)
    monkeypatch.setattr(background, "stage_save", held_stage_save)
    saver = BackgroundSaver()
    saver.start(str(async_dir), 4, model, shard, meta)
    model["w"].add_(1.0)
    shard["optimizers"][0]["state"][0]["momentum_buffer"].mul_(-1)
    shard["optimizers"][0]["param_groups"][0]["lr"] = 0.5
    meta["history"].append({"reward": 1.0})
    meta["history"][0]["reward"] = 0.25
    meta["user_config"]["lr"] = 0.2
    meta["data_position"] = 12
    release.set()
    saver.finish()
    for got, want in zip(load_checkpoint(str(async_dir), 4, "cpu", load_optimizer=True, rank=0),
                         load_checkpoint(str(sync_dir), 4, "cpu", load_optimizer=True, rank=0)):
        assert same(got, want)


def test_nothing_of_the_step_is_visible_until_the_commit(tmp_path, monkeypatch):
    release, real_stage = threading.Event(), store.stage

    def held_stage(path, write_fn, sweep_stale=False):
        release.wait(timeout=30)
        return real_stage(path, write_fn, sweep_stale)
    save_checkpoint(str(tmp_path), 1, state(1), optimizer_shard(1), {"step": 1})
    monkeypatch.setattr(store, "stage", held_stage)
    saver = BackgroundSaver()
    saver.start(str(tmp_path), 2, state(2), optimizer_shard(2), {"step": 2})
    assert saver.pending and list_steps(tmp_path) == [1]
    release.set()
    saver._thread.join()
    assert list_steps(tmp_path) == [1]  # written, not yet committed: only hidden temp files
    assert any(name.startswith(".model_000002.pt.tmp-") for name in os.listdir(tmp_path))
    saver.finish()
    assert list_steps(tmp_path) == [1, 2] and not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_a_failed_write_is_raised_at_the_commit_and_leaves_the_previous_step(tmp_path, monkeypatch):
    save_checkpoint(str(tmp_path), 1, state(1), optimizer_shard(1), {"step": 1})
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    real_stage = store.stage

    def full_disk(path, write_fn, sweep_stale=False):
        if os.path.basename(path) == "model_000002.pt":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_stage(path, write_fn, sweep_stale)
    monkeypatch.setattr(store, "stage", full_disk)
    saver = BackgroundSaver()
    saver.start(str(tmp_path), 2, state(2), optimizer_shard(2), {"step": 2}, after_commit=pytest.fail)
    with pytest.raises(UserError, match=r"could not write checkpoint model_000002.pt .*No space left on device"):
        saver.finish()
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    assert not saver.pending


def test_the_next_save_commits_the_last_one_first(tmp_path):
    saver, order = BackgroundSaver(), []
    saver.start(str(tmp_path), 2, state(2), optimizer_shard(2), {"step": 2}, after_commit=lambda: order.append(2))
    saver.start(str(tmp_path), 3, state(3), optimizer_shard(3), {"step": 3}, after_commit=lambda: order.append(3))
    assert order == [2] and list_steps(tmp_path) == [2]
    saver.finish()
    assert order == [2, 3] and list_steps(tmp_path) == [2, 3]
    assert same(load_checkpoint(str(tmp_path), 3, "cpu")[0], state(3))


def test_a_save_started_while_the_last_one_is_written_leaves_both_steps_as_they_were(tmp_path, monkeypatch):
    """The next save waits for the last one before it copies its own tensors: the host buffers it copies into are the
    last snapshot's, which the writer thread may still be reading. Here step 2's writer is held until step 3's save
    waits for it (its start() calls finish()), so a copy made before that wait went into step 2's buffers, and step 2's
    files held step 3's tensors; back-to-back saves of a fast step did just that. Both steps load as each step held."""
    release, real_stage = threading.Event(), store.stage

    def held_stage(path, write_fn, sweep_stale=False):
        if "_000002" in os.path.basename(path):
            release.wait(timeout=10)
        return real_stage(path, write_fn, sweep_stale)
    monkeypatch.setattr(store, "stage", held_stage)
    saver = BackgroundSaver()
    real_finish = saver.finish

    def finish():  # step 2's writer goes on once the next save (or the end) waits for it
        release.set()
        real_finish()
    saver.finish = finish
    saver.start(str(tmp_path), 2, state(2), optimizer_shard(2), {"step": 2})
    assert saver.pending and not saver.written
    saver.start(str(tmp_path), 3, state(3), optimizer_shard(3), {"step": 3})  # the same shapes: buffers reused
    saver.finish()
    assert list_steps(tmp_path) == [2, 3]
    for step in (2, 3):
        model, shard, meta = load_checkpoint(str(tmp_path), step, "cpu", load_optimizer=True, rank=0)
        assert same(model, state(step)), f"step {step}'s model file holds other tensors than step {step}'s"
        assert same(shard, optimizer_shard(step)) and meta["step"] == step, f"step {step}'s optimizer shard or meta"


def test_a_run_alone_trains_on_while_its_save_is_written_and_commits_it_once_written(sft, base_dir, monkeypatch, capsys):
    """One process (no collective to keep in step with): the save of step 3, whose writing is held until step 5's
    training, does not hold steps 4 and 5 back; it is committed before the first step's training after it is
    written (step 6's), and the last save at the run's end. With several ranks the commit stays before the next step's training (the
    distributed save tests)."""
    from helpers import TINY_RL_FLAGS

    from nanochat.checkpoints.loading import load_model
    from nanochat.rl import run as rl_run
    from scripts import chat_rl
    release, real_stage, real_train = threading.Event(), store.stage, rl_run.train_on_rollouts

    def held_stage(path, write_fn, sweep_stale=False):
        if os.path.basename(path) == "model_000003.pt":
            assert release.wait(timeout=60)
        return real_stage(path, write_fn, sweep_stale)

    def train(run, rollouts, step):
        print(f"training step {step}")
        if step == 5:
            release.set()
            run.checkpointer.saver._thread.join()  # written now: the next step start commits it
        return real_train(run, rollouts, step)
    monkeypatch.setattr(store, "stage", held_stage)
    monkeypatch.setattr(rl_run, "train_on_rollouts", train)
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=7", "--save-every=3"])
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith(("training step", "Saved checkpoint"))]
    saved_3 = next(i for i, line in enumerate(lines) if line.endswith("(step 3)"))
    assert lines.index("training step 4") < lines.index("training step 5") < saved_3 < lines.index("training step 6")
    assert lines[-1].endswith("(step 6)")  # the last step's save, committed at the end
    assert load_model("rl", "cpu", "eval", step=3)[2]["step"] == 3


def test_a_run_alone_that_fails_while_its_save_is_pending_commits_it(sft, base_dir, monkeypatch):
    """The save of step 3 is still in flight (held) when step 5's training raises: the run ends with that error,
    and the save, pending over steps 4 and 5, is committed on the way out (Checkpointer.on_error)."""
    from helpers import TINY_RL_FLAGS

    from nanochat.checkpoints.loading import load_model
    from nanochat.rl import run as rl_run
    from scripts import chat_rl
    release, real_stage = threading.Event(), store.stage

    def held_stage(path, write_fn, sweep_stale=False):
        if os.path.basename(path) == "model_000003.pt":
            assert release.wait(timeout=60)
        return real_stage(path, write_fn, sweep_stale)

    def train(run, rollouts, step):
        if step == 5:
            assert run.checkpointer.saver.pending
            release.set()
            raise RuntimeError("simulated failure in step 5's training")
        return real_train(run, rollouts, step)
    real_train = rl_run.train_on_rollouts
    monkeypatch.setattr(store, "stage", held_stage)
    monkeypatch.setattr(rl_run, "train_on_rollouts", train)
    with pytest.raises(RuntimeError, match="simulated failure"):
        chat_rl.main(TINY_RL_FLAGS + ["--num-steps=7", "--save-every=3"])
    assert load_model("rl", "cpu", "eval")[2]["step"] == 3  # the latest complete step


def test_the_final_evals_meta_goes_to_the_step_saved_last_and_nowhere_else(tmp_path):
    """Checkpointer.refresh_meta (a step's meta rewritten with what followed it: chat_rl's final eval) rewrites the step
    the run saved last, and writes nothing for a step it did not save: a meta without its model would read as a
    broken checkpoint (issue 67: a refresh of any step passed the checkpoint tests)."""
    from nanochat.checkpoints.checkpointer import Checkpointer
    from nanochat.checkpoints.layout import meta_path

    def snapshot(step):
        return state(step), optimizer_shard(step), {"step": step, "user_config": {}}
    checkpointer = Checkpointer(str(tmp_path), rank=0, world_size=1, keep_last=0, snapshot=snapshot)
    checkpointer.save(2)
    checkpointer.finish()
    checkpointer.refresh_meta(3, {"step": 3, "final_eval": 0.5})  # step 3 ran, but was never saved
    assert sorted(os.listdir(tmp_path)) == ["meta_000002.json", "model_000002.pt", "optim_000002_rank0.pt"]
    checkpointer.refresh_meta(2, {"step": 2, "final_eval": 0.25})
    _, _, meta = load_checkpoint(str(tmp_path), 2, "cpu")
    assert meta == {"step": 2, "final_eval": 0.25} and os.path.exists(meta_path(str(tmp_path), 2))


class RecordedSaver:
    """A BackgroundSaver's commits as events: which one the Checkpointer asked for, in order."""

    def __init__(self, events):
        self.events = events

    def finish(self):
        self.events.append("finish")

    def commit_if_written(self):
        self.events.append("commit_if_written")


@pytest.mark.parametrize("world_size, commit", [(2, "finish"), (1, "commit_if_written")])
def test_written_behind_commits_at_the_stretchs_end_and_not_on_its_error(tmp_path, world_size, commit):
    """Checkpointer.written_behind, around a step's stretch without collectives (its first draw): nothing committed
    while it runs, the commit at its end (several ranks: the save finished there, on every rank; alone: committed if
    written, waiting for nothing); an error inside commits nothing there (an exit would race the other ranks to a
    collective), but on_error around the loop does, and the error is the one raised."""
    from nanochat.checkpoints.checkpointer import Checkpointer
    events = []
    checkpointer = Checkpointer(str(tmp_path), rank=0, world_size=world_size, keep_last=0, snapshot=None)
    checkpointer.saver = RecordedSaver(events)
    with checkpointer.written_behind():
        events.append("draw")
    events.append("agreement")
    assert events == ["draw", commit, "agreement"]
    events.clear()
    with pytest.raises(RuntimeError, match="out of luck"):
        with checkpointer.on_error():
            with checkpointer.written_behind():
                events.append("draw")
                raise RuntimeError("out of luck")
    assert events == ["draw", "finish"]


def test_the_last_saved_step_is_named_once_committed_and_an_eval_follows_a_commit(tmp_path):
    """settled_last (what a run stopped by non-finite steps names) commits the save in flight first: the step just
    saved, not the one before it; before_eval leaves the step committed on disk; a run that saved nothing names
    none."""
    from nanochat.checkpoints.checkpointer import Checkpointer

    def snapshot(step):
        return state(step), optimizer_shard(step), {"step": step, "user_config": {}}
    checkpointer = Checkpointer(str(tmp_path), rank=0, world_size=1, keep_last=0, snapshot=snapshot)
    assert checkpointer.settled_last() is None
    checkpointer.save(2)
    checkpointer.before_eval()
    assert list_steps(str(tmp_path)) == [2] and not checkpointer.saver.pending
    checkpointer.save(4)
    assert checkpointer.settled_last() == 4 and list_steps(str(tmp_path)) == [2, 4]
