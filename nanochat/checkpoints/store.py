"""
Saving checkpoints, and reading their files back, in nanochat's on-disk layout (nanochat/checkpoints/layout.py):

    $NANOCHAT_BASE_DIR/{base,mid,chatsft,chatrl}_checkpoints/<tag>/
        model_<step:06d>.pt            torch.save'd model state_dict            (rank 0)
        meta_<step:06d>.json           json, indent 2, with "model_config"      (rank 0)
        optim_<step:06d>_rank<r>.pt    optimizer state of rank r (optional)     (every rank)

Writes are atomic: every file is written to a hidden temp file in the same directory, fsynced, and
only then renamed over its final name, so a crash or a full disk never leaves a truncated
`model_N.pt` for the loader to pick up, and never touches the files of another step.

Commit order: all files are staged as temp files first; then they are renamed optimizer shard -> meta ->
model. The model file is renamed last because it is the file that step resolution looks for (`model_N.pt`,
as upstream nanochat does): once it is visible, the meta it needs is already there. A failure while staging
leaves no trace of the step at all. With `all_ranks=True` (every rank of a process group saves together, as
chat_rl does) the ranks agree between the phases: every rank stages; if any rank failed (a full disk on one
node), every rank removes its temp files and raises that rank's error; else every rank renames its shard,
and only when all shards are in place does rank 0 rename the meta and then the model. A process killed at
any moment (SIGKILL, a lost node) therefore leaves the previous step as the latest complete one on every rank.

chat_rl's checkpoints also record a run id (in the meta and in every shard) and the world size. What is done with
the optimizer shards on `--resume` (checked against the meta, re-split for another number of ranks) is in
nanochat/checkpoints/optimizer_shards.py; removing a run's older steps (`--keep-last`) in nanochat/checkpoints/pruning.py.
Loading a model from them is nanochat/checkpoints/loading.py; their errors are nanochat/checkpoints/errors.py.
"""

import contextlib
import errno
import json
import os
import pickle
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanochat.checkpoints.errors import (CheckpointWriteError, CorruptCheckpointError, MissingMetaError, NoStepsError,
                                         RankLostError, UnknownStepError)
from nanochat.checkpoints.layout import MODEL_FILE_RE, TAG_RE, meta_path, model_path, optim_path
from nanochat.errors import UserError
from nanochat.files import atomic_write, fsync_dir, remove_if_exists, stage, temp_path
from nanochat.runtime.distributed import get_rank

# -----------------------------------------------------------------------------
# saving

def _write_error(directory, name, e):
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space or pass a different base dir (NANOCHAT_BASE_DIR)"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make it writable or set NANOCHAT_BASE_DIR to a writable directory"
    else:
        fix = "check the disk, or set NANOCHAT_BASE_DIR to another directory"
    return CheckpointWriteError(directory, name, reason, fix)


def make_checkpoint_dir(checkpoint_dir):
    """Create the directory, or say in one line why it cannot be (so a run can check before it trains)."""
    try:
        os.makedirs(checkpoint_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"could not create checkpoint directory {checkpoint_dir}: {e.strerror or e}; "
                        f"make its parent writable or set NANOCHAT_BASE_DIR to a writable directory") from e


def save_checkpoint(checkpoint_dir, step, model_data, optimizer_data, meta_data, rank=None, all_ranks=False):
    """Save one step. Rank 0 writes the model state dict and the meta json; every rank whose
    optimizer_data is not None writes its own optimizer shard. Other ranks may pass model_data=None.
    rank: this process's rank; None = distributed.get_rank().
    all_ranks: every rank of the process group calls this together (chat_rl): model_N.pt appears only once every
    rank's shard of step N is in place, and a failure on any rank raises on every rank, with the message of the
    lowest failed rank, so rank 0 can say it (see the module docstring). Without a process group, as False.

    Disk errors (full disk, permissions) raise UserError after removing every temp file; an existing
    checkpoint of this or any other step is left as it was. Errors that are bugs (unpicklable or
    non-json data) are cleaned up the same way but re-raised unchanged (on the other ranks of an all_ranks save:
    a UserError naming the rank).

    The two phases are also callable apart (nanochat/checkpoints/background.py writes in a thread): stage_save
    writes the temp files and touches nothing shared; commit_save, on the main thread, makes them the step.
    """
    commit_save(stage_save(checkpoint_dir, step, model_data, optimizer_data, meta_data, rank=rank, all_ranks=all_ranks))


@dataclass
class StagedSave:
    """One step's files as stage_save left them: written to temp files (`staged`, in rename order), or `error`."""
    checkpoint_dir: str
    step: int
    together: bool          # every rank of the process group commits it together
    shard: list             # this rank's shard's final path (or none)
    rank0_files: list       # rank 0's meta and model final paths, in rename order (other ranks: none)
    staged: list = field(default_factory=list)  # temp paths not yet renamed
    error: BaseException = None
    current: str = None     # the final path being written or renamed when something failed


def encode_meta(meta_data):
    """The meta json's bytes; a value json cannot hold is a TypeError (a bug), raised before anything is written."""
    return json.dumps(meta_data, indent=2).encode("utf-8")


def stage_save(checkpoint_dir, step, model_data, optimizer_data, meta_data, rank=None, all_ranks=False):
    """The first phase of save_checkpoint: this rank's files written whole to temp files (flushed, fsynced) beside
    their final names. File I/O only, no collective and no rename: safe on a writer thread. A failure is kept in
    the StagedSave's `error` for commit_save (which removes the temp files); meta_data may be encode_meta's bytes."""
    rank = get_rank() if rank is None else rank
    if rank == 0 and model_data is None:
        raise ValueError("rank 0 must pass model_data (the model's state_dict) to save_checkpoint")
    save = StagedSave(checkpoint_dir, step, all_ranks and dist.is_initialized(),
                      shard=[optim_path(checkpoint_dir, step, rank)] if optimizer_data is not None else [],
                      rank0_files=[meta_path(checkpoint_dir, step), model_path(checkpoint_dir, step)] if rank == 0 else [])
    writers = {}
    try:
        try:
            if rank == 0:  # serialized before touching the disk: a non-json value is a bug and must leave no files
                meta_bytes = meta_data if isinstance(meta_data, bytes) else encode_meta(meta_data)
                writers[save.rank0_files[0]] = lambda f: f.write(meta_bytes)
                writers[save.rank0_files[1]] = lambda f: torch.save(model_data, f)
            if save.shard:
                writers[save.shard[0]] = lambda f: torch.save(optimizer_data, f)
            make_checkpoint_dir(checkpoint_dir)
            for path in save.shard + save.rank0_files:
                save.current = path
                save.staged.append(temp_path(path))
                stage(path, writers[path], sweep_stale=True)  # temp files of killed runs: one process writes each file
        except Exception as e:
            save.error = e
    except BaseException:  # an interrupt: nothing of the step may stay behind
        remove_staged(save)
        raise
    return save


def commit_save(save):
    """The second phase of save_checkpoint, on the main thread: with all_ranks, every rank learns whether every rank
    staged its files; then this rank's shard is renamed into place, then (once every shard is) rank 0's meta and
    model. Any failure removes this rank's temp files and raises (see save_checkpoint)."""
    checkpoint_dir, step, together = save.checkpoint_dir, save.step, save.together
    try:
        if together:  # every rank learns whether every rank has staged its files, before any rename
            with _peers(checkpoint_dir, step):
                failed_rank, message = first_failure(save.error and _failure_message(save.error, checkpoint_dir,
                                                                                     save.current))
            if save.error is None and failed_rank is not None:
                raise UserError(f"rank {failed_rank}: {message}")
        if save.error is not None:
            raise save.error
        for path in save.shard:
            save.current = path
            os.replace(save.staged[0], path)
            save.staged.pop(0)  # only once renamed: a failed rename leaves the temp file for the cleanup below
        if together:
            fsync_dir(checkpoint_dir)
            with _peers(checkpoint_dir, step):
                dist.barrier()  # every rank's shard is in place: the step may become visible
        for path in save.rank0_files:
            save.current = path
            os.replace(save.staged[0], path)
            save.staged.pop(0)
        fsync_dir(checkpoint_dir)
        if together:
            with _peers(checkpoint_dir, step):
                dist.barrier()  # complete on every rank before any returns to prune, or to exit (torchrun then
                                # stops the other ranks, which could be rank 0 in the middle of its renames)
    except BaseException as e:
        remove_staged(save)
        if isinstance(e, OSError):
            raise _write_error(checkpoint_dir, os.path.basename(save.current or checkpoint_dir), e) from e
        raise


def remove_staged(save):
    """Remove the temp files a StagedSave has not renamed (best effort)."""
    for tmp in save.staged:
        try:
            remove_if_exists(tmp)
        except OSError:
            pass  # the original error is the one worth reporting; a leftover hidden temp file is harmless
    save.staged.clear()


@contextlib.contextmanager
def _peers(checkpoint_dir, step):
    """Around a save's collectives: a rank that vanished (gloo: 'Connection reset by peer', a RuntimeError) is one
    line on the ranks left, not a traceback."""
    try:
        yield
    except RuntimeError as e:
        raise RankLostError(checkpoint_dir, step, e) from e


def _failure_message(e, checkpoint_dir, current):
    """One line for the other ranks about this rank's failed save."""
    if isinstance(e, OSError):
        return str(_write_error(checkpoint_dir, os.path.basename(current or checkpoint_dir), e))
    return str(e) if isinstance(e, UserError) else f"{type(e).__name__} while saving a checkpoint: {e}"


def first_failure(message):
    """Every rank's `message` (None = no failure) gathered: (rank, message) of the lowest rank that failed, or
    (None, None). A collective: every rank of the process group calls it."""
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    failed = next(((r, m) for r, m in enumerate(messages) if m is not None), (None, None))
    if failed[0] is not None:
        # every rank is about to raise and tear the process group down; with the gather as the last collective, gloo
        # aborted a rank at exit (SIGABRT: 5 of 16 2-rank resumes); a barrier last, as a run that ends well has: 0 of 48
        dist.barrier()
    return failed


def new_run_id():
    """A fresh id for a new run, the same on every rank (rank 0's, broadcast): recorded in the meta and in every
    optimizer shard, so that a shard of another run is recognised on --resume."""
    run_id = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(run_id, src=0)
    return run_id[0]


def update_meta(checkpoint_dir, step, meta_data):
    """Replace the meta json of a saved step (rank 0 only), atomically: e.g. to add the eval that ran after the
    step's model was saved. Disk errors raise UserError, as in save_checkpoint."""
    meta_bytes = encode_meta(meta_data)
    path = meta_path(checkpoint_dir, step)
    try:
        atomic_write(path, meta_bytes, sweep_stale=True)
    except OSError as e:
        raise _write_error(checkpoint_dir, os.path.basename(path), e) from e


# -----------------------------------------------------------------------------
# loading

def list_steps(checkpoint_dir):
    """Sorted steps N that have a file named exactly model_N.pt (backups and temp files are ignored)."""
    if not os.path.isdir(checkpoint_dir):
        return []
    steps = [int(m.group(1)) for m in map(MODEL_FILE_RE.match, os.listdir(checkpoint_dir)) if m]
    return sorted(steps)


def find_last_step(checkpoint_dir):
    steps = list_steps(checkpoint_dir)
    if not steps:
        raise NoStepsError(checkpoint_dir)
    return steps[-1]


def list_tags(checkpoints_dir):
    if not os.path.isdir(checkpoints_dir):
        return []
    return sorted(d for d in os.listdir(checkpoints_dir) if os.path.isdir(os.path.join(checkpoints_dir, d)))


def find_largest_model(checkpoints_dir):
    """nanochat's default tag: the largest depth N among tags starting with `d<N>` (as an integer: d12 beats d4;
    `d32_long` counts as 32), else, with no such tag, the most recently modified directory.
    nanochat breaks a tie in depth (d32, d32_long) by directory listing order, which the filesystem decides;
    here the most recently modified of the tied directories wins, so the choice is reproducible."""
    tags = list_tags(checkpoints_dir)
    if not tags:
        raise UserError(f"no model directories in {checkpoints_dir}; train a model or copy a <tag> directory there")
    mtime = lambda t: os.path.getmtime(os.path.join(checkpoints_dir, t))
    depths = {tag: int(m.group(1)) for tag in tags if (m := TAG_RE.match(tag))}
    if depths:
        return max(depths, key=lambda t: (depths[t], mtime(t)))
    return max(tags, key=mtime)


def torch_load_checked(path, device, mmap=False):
    """torch.load of a checkpoint file (tensors and plain containers only), its failures as one-line UserErrors.
    mmap: map the file instead of reading it (tensors then read their pages when used; device must be cpu)."""
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise
    except PermissionError as e:
        raise UserError(f"cannot read checkpoint file {path}: {e.strerror}; fix its permissions") from e
    except pickle.UnpicklingError as e:
        if "unsupported global" in str(e).lower():  # a real pickle of non-tensor objects, not damage
            raise UserError(f"checkpoint file {path} holds Python objects other than tensors and plain containers; "
                            f"refusing to unpickle it (that could run arbitrary code); re-save it as a plain state_dict") from e
        raise CorruptCheckpointError(path, "corrupted (not a torch checkpoint)") from e
    except Exception as e:
        # truncated files surface as EOFError, RuntimeError (zip reader) or OSError(EINVAL), depending on where they end
        first_line = str(e).splitlines()[0].split(". ")[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(path, f"corrupted or truncated ({first_line})") from e


def load_checkpoint(checkpoint_dir, step, device, load_optimizer=False, rank=None):
    """Returns (model_data, optimizer_data or None, meta_data); tensors are mapped onto `device`.
    rank: whose optimizer shard to load; None = distributed.get_rank()."""
    mpath, jpath = model_path(checkpoint_dir, step), meta_path(checkpoint_dir, step)
    if not os.path.exists(mpath):
        raise UnknownStepError(checkpoint_dir, step, list_steps(checkpoint_dir))
    if not os.path.exists(jpath):
        raise MissingMetaError(checkpoint_dir, step)
    model_data = torch_load_checked(mpath, device)
    optimizer_data = load_optimizer_state(checkpoint_dir, step, device, rank) if load_optimizer else None
    return model_data, optimizer_data, load_meta(checkpoint_dir, step)


def load_meta(checkpoint_dir, step):
    """The meta json of a saved step (e.g. a run's flags, read before anything heavier is loaded)."""
    jpath = meta_path(checkpoint_dir, step)
    if not os.path.exists(jpath):
        raise MissingMetaError(checkpoint_dir, step)
    try:
        with open(jpath, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(jpath, f"corrupted (not valid json: {e})") from e


def load_optimizer_state(checkpoint_dir, step, device, rank=None):
    """This rank's optimizer shard of a saved step (without reading the model file, which a resume has already
    loaded). rank: None = distributed.get_rank()."""
    opath = optim_path(checkpoint_dir, step, get_rank() if rank is None else rank)
    if not os.path.exists(opath):
        raise UserError(f"no optimizer state {opath}: this checkpoint was saved without it (or with fewer ranks); "
                        f"resume from a step saved with optimizer state, or start the optimizer fresh")
    return torch_load_checked(opath, device)
