"""
A training run's checkpoint protocol in one object, called once at each point of the loop:

    save(step)            begin saving a step: its tensors copied to host memory, its files written by a thread
    written_behind()      around the stretch of a step that runs no collective (its rollouts' first draw): the save
                          written meanwhile, committed at the stretch's end (before_collective): with several ranks
                          there on every rank (the commit is a collective of its own, which must come at the same
                          point on every rank); alone, once written, waiting for nothing
    before_eval()         commit whatever is in flight: the eval's collectives follow
    finish()              commit whatever is in flight: a stop, the run's end
    settled_last()        commit whatever is in flight, then the run's last saved step: what a run that stops names
    refresh_meta(step, meta)  rewrite the meta of the last saved step (the final eval is of that model)
    on_error()            around the loop: a run that stops on an error still commits the save in flight
A write that fails at any of them is one line naming the file and the step the run kept (kept()).

What a step holds (the model, every rank's optimizer shard, the meta) comes from the run: `snapshot(step)`.
"""

import contextlib
import os

from nanochat.checkpoints.background import BackgroundSaver
from nanochat.checkpoints.errors import CheckpointWriteError
from nanochat.checkpoints.pruning import prune_checkpoints, remove_extra_shards
from nanochat.checkpoints.store import update_meta
from nanochat.runtime.distributed import print0


class Checkpointer:
    """The saves of one run into `checkpoint_dir`: each step written by a thread (BackgroundSaver), committed on
    every rank at the points above, then the shards of ranks the run no longer has removed and --keep-last applied.
    `snapshot(step)` returns (model state_dict or None off rank 0, this rank's optimizer shard, the meta);
    `last_saved`: the run's last committed step (a resumed run's start step - 1), or None."""

    def __init__(self, checkpoint_dir, rank, world_size, keep_last, snapshot, last_saved=None):
        self.checkpoint_dir, self.rank, self.world_size, self.keep_last = checkpoint_dir, rank, world_size, keep_last
        self.snapshot, self.last_saved = snapshot, last_saved
        self.saver = BackgroundSaver()  # the checkpoint being written, if any

    def save(self, step):
        """Begin saving the step for --resume: the model (rank 0) and every rank's optimizer shard, copied to host
        memory now and written by a thread; finish() commits it (the step appears, model_N.pt, only once every
        rank's shard is in place), after which --keep-last removes this run's older steps."""
        model_state, shard, meta = self.snapshot(step)
        with self.kept_said():  # the previous save, committed first, may fail
            self.saver.start(self.checkpoint_dir, step, model_state, shard, meta, rank=self.rank, all_ranks=True,
                             after_commit=lambda: self._saved(step))

    def _saved(self, step):
        """What follows a step's commit: shards of ranks the run no longer has removed, the line, --keep-last."""
        if self.rank == 0:  # a run resumed on fewer ranks saving a step that more ranks saved before
            remove_extra_shards(self.checkpoint_dir, step, self.world_size)
        self.last_saved = step
        print0(f"Saved checkpoint to {self.checkpoint_dir} (step {step})")
        if self.keep_last > 0:  # only this run's directory: the start checkpoint is another's (resolve_output_tag)
            removed = prune_checkpoints(self.checkpoint_dir, step, self.keep_last)
            if removed:
                print0(f"--keep-last={self.keep_last}: removed step{'s' * (len(removed) > 1)} "
                       f"{', '.join(map(str, removed))}")

    def before_collective(self):
        """Before a step's first collective: with several ranks, the last checkpoint committed (see on_error). A run
        alone has no collective to keep in step with: it commits the checkpoint once written, waiting for nothing
        (the next save, an eval, the end, a stop or an error waits for it). On an H200 a d20 save's write took 6 s,
        which a step's rollout (1.7 s) could not hide."""
        with self.kept_said():
            if self.world_size > 1:
                self.saver.finish()
            else:
                self.saver.commit_if_written()

    @contextlib.contextmanager
    def written_behind(self):
        """Around the stretch of a step that runs no collective (chat_rl's: its rollouts' first draw): the save in
        flight written by its thread meanwhile, and committed at the stretch's end, before the step's first
        collective (before_collective). An error inside commits nothing here: on_error, around the loop, does."""
        yield
        self.before_collective()

    def before_eval(self):
        """Before an eval: the save in flight, if any, committed (the eval's collectives come next; the final eval is
        of the last saved step, whose meta refresh_meta rewrites)."""
        self.finish()

    def finish(self):
        """The save in flight, if any, committed (waiting for its thread)."""
        with self.kept_said():
            self.saver.finish()

    def settled_last(self):
        """The run's last saved step once the save in flight, if any, is committed (what a run that stops names), or
        None if none was."""
        self.finish()
        return self.last_saved

    def refresh_meta(self, step, meta):
        """The meta of `step` rewritten (rank 0), if `step` is the last one saved: what followed it (the final eval)."""
        if self.last_saved == step and self.rank == 0:
            with self.kept_said():
                update_meta(self.checkpoint_dir, step, meta)

    def kept(self):
        """What the run still has on disk, as a failed write's line says it."""
        if self.last_saved is None:
            return "no checkpoint of this run had been saved yet"
        tag = os.path.basename(self.checkpoint_dir)
        return f"the checkpoint of step {self.last_saved} was kept (--resume={tag}:{self.last_saved} continues from it)"

    @contextlib.contextmanager
    def kept_said(self):
        """A checkpoint that could not be written: its one line says too which step the run kept (kept())."""
        try:
            yield
        except CheckpointWriteError as e:
            raise e.with_kept(self.kept()) from e

    @contextlib.contextmanager
    def on_error(self):
        """Around the training loop: a run that stops on an error still commits the checkpoint its thread was writing.
        With several ranks a save is pending only between a step's end and the end of the next step's first draw of
        rollouts, a stretch without collectives (written_behind), so every rank reaches a commit: its own here, or
        the one at that stretch's end. Alone, a run's save may stay pending for steps (before_collective): committed
        here all the same."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the error that stopped the run is the one to report
                self.saver.finish()
            raise

