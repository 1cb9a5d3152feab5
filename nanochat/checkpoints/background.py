"""
Checkpoint saves off the training's critical path: the step's tensors are copied to host memory (the snapshot:
training goes on changing the originals), a thread writes the files (stage_save: file I/O only), and the main
thread commits them at a join point of its choosing (commit_save: the agreement between ranks, the renames,
then whatever follows a save, such as --keep-last). One save is in flight at a time: the next save, the run's end
and a stop on request wait for the previous one.

Every guarantee of nanochat/checkpoints/store.py holds: until the commit, the step exists only as hidden temp
files, so a kill while the thread writes leaves the previous step as the latest complete one, and a failed write
is raised at the commit, on every rank, after its temp files are removed.
"""

import copy
import threading

import torch

from nanochat.checkpoints.store import commit_save, stage_save
from nanochat.runtime.device import synchronize
from nanochat.runtime.distributed import get_rank


def host_copy(data, reuse=()):
    """`data` (nested dicts, lists and tuples of tensors and plain values) with every tensor copied to host memory,
    detached: what the files will hold, fixed at this moment. Returns (the copy, its host tensors in order). A host
    tensor of `reuse` (an earlier copy's, whose files are written) of the same shape and dtype at the same place
    is written over instead of allocated. Copies off an accelerator go through pinned memory without blocking,
    and one synchronization waits for all of them."""
    host_tensors, devices = [], set()

    def copy(value):
        if isinstance(value, torch.Tensor):
            i = len(host_tensors)
            old = reuse[i] if i < len(reuse) else None
            fits = old is not None and old.shape == value.shape and old.dtype == value.dtype
            if value.device.type == "cpu":
                host = old.copy_(value.detach()) if fits else value.detach().clone()
            else:
                host = old if fits else torch.empty(value.shape, dtype=value.dtype,
                                                    pin_memory=value.device.type == "cuda")
                host.copy_(value.detach(), non_blocking=True)
                devices.add(value.device)
            host_tensors.append(host)
            return host
        if isinstance(value, dict):
            copied = type(value)((k, copy(v)) for k, v in value.items())
            if hasattr(value, "_metadata"):  # a state_dict's module versions, which torch.save writes too
                copied._metadata = value._metadata
            return copied
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value
    result = copy(data)
    for device in devices:
        synchronize(device)
    return result, host_tensors


class BackgroundSaver:
    """Saves written by a thread and committed on the main thread (see the module docstring). Not thread-safe
    itself: one training loop drives it."""

    def __init__(self):
        self._thread = None
        self._staged = None       # the StagedSave the thread hands back
        self._after_commit = None
        self._host_tensors = []   # the last snapshot's, reused by the next once its files are written

    @property
    def pending(self):
        return self._thread is not None

    def start(self, checkpoint_dir, step, model_data, optimizer_data, meta_data, rank=None, all_ranks=False,
              after_commit=None):
        """Begin saving a step (arguments as store.save_checkpoint): the previous save committed first, this one's
        tensors copied to host memory and its meta encoded now, its files written by a thread. after_commit() runs
        on the main thread once the step is in place."""
        if (get_rank() if rank is None else rank) == 0 and model_data is None:
            raise ValueError("rank 0 must pass model_data (the model's state_dict) to save_checkpoint")
        self.finish()
        (model_copy, optimizer_copy), self._host_tensors = host_copy((model_data, optimizer_data), self._host_tensors)
        snapshot = (model_copy, optimizer_copy, copy.deepcopy(meta_data))  # encoded by the thread, as a sync save does
        self._after_commit = after_commit

        def write():
            self._staged = stage_save(checkpoint_dir, step, *snapshot, rank=rank, all_ranks=all_ranks)
        self._thread = threading.Thread(target=write, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    @property
    def written(self):
        """Whether a save is in flight whose thread is done (written, or failed): finish() would not wait."""
        return self._thread is not None and not self._thread.is_alive()

    def commit_if_written(self):
        """Commit the save in flight if its thread has written it, without waiting for one still writing. Only where
        no other rank takes part (a commit with all_ranks is a collective, which every rank must reach together)."""
        if self.written:
            self.finish()

    def finish(self):
        """Wait for the save in flight, if any, and commit it (a collective with all_ranks: every rank calls this at
        the same point). Raises what the save raised, after its temp files are gone."""
        if self._thread is None:
            return
        self._thread.join()
        staged, after_commit = self._staged, self._after_commit
        self._thread = self._staged = self._after_commit = None
        if staged is None:  # the thread died before stage_save returned (it catches what a write raises)
            raise RuntimeError("the checkpoint writer thread ended without staging its files")
        commit_save(staged)
        if after_commit is not None:
            after_commit()
