"""
Removing a run's checkpoint files that are no longer wanted: the steps beyond `--keep-last`, and the shards of a
re-saved step that a run of more ranks left (a run resumed on fewer ranks saves a step again with fewer shards).

Every rank removes only the files it writes (rank 0 the model and meta, rank r its own shard); the shards of
ranks this run does not have are rank 0's to remove. See nanochat/checkpoints/store.py for the layout.
"""

import os
import re

import torch.distributed as dist

from nanochat.checkpoints.layout import optim_path
from nanochat.checkpoints.store import list_steps
from nanochat.files import fsync_dir, remove_if_exists
from nanochat.runtime.distributed import get_rank

# every file of a step: model_N.pt, meta_N.json, optim_N_rank<r>.pt (groups 1-3: the step; group 4: the rank)
STEP_FILE_RE = re.compile(r"^(?:model_(\d+)\.pt|meta_(\d+)\.json|optim_(\d+)_rank(\d+)\.pt)$")
TEMP_FILE_RE = re.compile(r"^\.(.+)\.tmp-\d+$")  # files.temp_path's name: .<final name>.tmp-<pid>


def _step_of(name):
    """(step, final file name) of a model, meta or shard file of a step, or of the temp file a killed save left for
    one (.model_N.pt.tmp-<pid>); None for any other file."""
    temp = TEMP_FILE_RE.match(name)
    final = temp.group(1) if temp else name
    m = STEP_FILE_RE.match(final)
    return (int(next(g for g in m.groups()[:3] if g is not None)), final) if m else None


def _owned(name, rank, world_size):
    """Whether rank `rank` of `world_size` removes the step file `name`: rank 0 the model and meta, each rank its
    own shard, and rank 0 the shards of ranks this run does not have (a run saved by more ranks, resumed on fewer)."""
    m = STEP_FILE_RE.match(name)
    if m.group(4) is None:
        return rank == 0
    owner = int(m.group(4))
    return owner == rank or (owner >= world_size and rank == 0)


def prune_checkpoints(checkpoint_dir, step, keep_last, rank=None, world_size=None):
    """After step `step` was saved, complete on every rank: remove the earlier steps of this run directory beyond the
    `keep_last` most recent (`step` included), so that keep_last steps remain. Never removed: `step`, the steps
    after it (a run resumed from an earlier step leaves them as they are), and any file outside `checkpoint_dir`.

    Rank 0 decides which steps stay, from the model files it sees, and tells the other ranks (a node need not see
    rank 0's files); each rank then removes only the files it writes: rank 0 a step's model file first (from then
    on no loader sees the step), then its meta and shard; rank r its shard. Files of earlier steps that have no
    model file (a save killed after its shards were renamed) go too, and so do the temp files killed saves left
    (a half-written model can be as large as a whole one). A collective under a process group: every rank calls
    it. Returns the steps this rank removed files of. rank, world_size: None = the process group's (else 0 of 1)."""
    rank = get_rank() if rank is None else rank
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    steps = [s for s in list_steps(checkpoint_dir) if s < step]
    keep = [steps[-(keep_last - 1):] if keep_last > 1 else []]
    if dist.is_initialized():
        dist.broadcast_object_list(keep, src=0)
    keep = set(keep[0])
    doomed = []  # (step, this rank's file) of the steps that go
    for name in os.listdir(checkpoint_dir):
        found = _step_of(name)
        if found and found[0] < step and found[0] not in keep and _owned(found[1], rank, world_size):
            doomed.append((found[0], not name.startswith("model_"), name))  # a step's model file first
    removed, failed = [], set()
    for doomed_step, _, name in sorted(doomed):
        if doomed_step in failed:
            continue
        try:
            remove_if_exists(os.path.join(checkpoint_dir, name))
        except OSError as e:  # the new step is saved: a leftover is not worth the run, and the next prune retries it;
            # leaving the rest of that step never leaves a meta or shard of a loadable step without its model file
            print(f"warning: --keep-last could not remove {name} ({e.strerror}); the next save tries again", flush=True)
            failed.add(doomed_step)
            continue
        removed.append(doomed_step)
    if doomed:
        fsync_dir(checkpoint_dir)
    return sorted(set(removed))


def remove_extra_shards(checkpoint_dir, step, world_size):
    """After `world_size` ranks saved step `step`: remove that step's shards of ranks >= world_size, left by an
    earlier save of the same step by more ranks (the meta now records world_size, so they would only mislead).
    Rank 0's job; returns the ranks whose shard was removed."""
    extra = sorted(int(m.group(4)) for m in map(STEP_FILE_RE.match, os.listdir(checkpoint_dir))
                   if m and m.group(4) is not None and int(m.group(3)) == step and int(m.group(4)) >= world_size)
    for r in extra:
        remove_if_exists(optim_path(checkpoint_dir, step, r))
    if extra:
        fsync_dir(checkpoint_dir)
    return extra
