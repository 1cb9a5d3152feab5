"""
The optimizer state of a chat_rl checkpoint: one shard per rank (`optim_<step>_rank<r>.pt`), checked on `--resume`
and, when the run continues on another number of ranks, gathered and re-split for the new one.

What a rank holds depends on the world size W that wrote it (see nanochat/optim/adamw.py and nanochat/optim/muon.py):
  - AdamW: a parameter of >= 1024 elements whose dim 0 divides by W keeps the moments of its rows
    [r * rows/W, (r+1) * rows/W) on rank r; any other parameter keeps its whole moments on every rank (the same
    values: its gradient was all-reduced);
  - Muon: a group of B same-shaped matrices gives matrix j to rank j // ceil(B/W), and only that rank has its state;
  - W = 1: everything on rank 0. Without a process group chat_rl steps torch's own AdamW (the step count a float
    tensor) and the single-process Muon; with one, DistAdamW/DistMuon (an int step count); MuonAdamW either way.
`gather_optimizer_states` turns the W shards into the state one process would hold (moments whole, every matrix's
state, step counts as ints); `split_optimizer_states` cuts that for rank r of W' ranks and the optimizer types of
the run that loads it. Both only move tensors: a state re-split for W' and gathered again is the saved one, bit
for bit. Hyperparameters (each group's lr, initial_lr, ...) come from the saved groups.
"""

import os

import torch
import torch.distributed as dist

from nanochat.checkpoints.errors import CheckpointError
from nanochat.checkpoints.layout import optim_path
from nanochat.checkpoints.store import first_failure, torch_load_checked
from nanochat.errors import UserError
from nanochat.optim.adamw import is_sharded
from nanochat.optim.muon import Muon
from nanochat.runtime.distributed import get_rank


class ShardError(CheckpointError):
    """An optimizer shard that is missing, or that is not the one its step's meta describes (another step, rank,
    world size or run); `path` is the shard file, `reason` what was found."""

    def __init__(self, path, reason):
        super().__init__(f"optimizer shard {path} {reason}", path)
        self.reason = reason


def check_shard(data, path, step, rank, world_size, run_id):
    """Raise ShardError unless `data` (the loaded file `path`) is the optimizer shard of rank `rank` in a save of
    step `step` by `world_size` ranks of the run `run_id`. What a shard of an older version does not record
    (run id, step, rank), and a run_id of None (a meta from before run ids), is not checked."""
    if not isinstance(data, dict) or not isinstance(data.get("optimizers"), list):
        raise ShardError(path, 'is not an optimizer shard (no "optimizers" list in it)')
    if run_id is not None and data.get("run_id") != run_id:
        raise ShardError(path, f"is from another run (run id {data.get('run_id')}; the meta of step {step} records "
                               f"run {run_id})")
    if data.get("step", step) != step:
        raise ShardError(path, f"holds step {data['step']}, not step {step}")
    if (data.get("rank", rank), data.get("world_size", world_size)) != (rank, world_size):
        raise ShardError(path, f"was written by rank {data.get('rank', '?')} of {data.get('world_size', '?')} ranks, "
                               f"not by rank {rank} of {world_size}")


def read_shard(checkpoint_dir, step, rank, world_size, run_id, device, mmap=False):
    """Rank `rank`'s shard of step `step` as saved by `world_size` ranks, checked (check_shard); a missing or
    unreadable file is a ShardError or CorruptCheckpointError naming it."""
    path = optim_path(checkpoint_dir, step, rank)
    if not os.path.exists(path):
        raise ShardError(path, f"is missing (step {step} was saved by {world_size} rank{'s' * (world_size != 1)}; each "
                               f"writes its own shard)")
    data = torch_load_checked(path, device, mmap=mmap)
    check_shard(data, path, step, rank, world_size, run_id=run_id)
    return data


def saved_world_size(checkpoint_dir, step, meta, default):
    """How many ranks saved step `step`: the meta's "world_size"; for a checkpoint from before the meta recorded it,
    rank 0's shard's own record; else `default`."""
    if meta.get("world_size") is not None:
        return meta["world_size"]
    path = optim_path(checkpoint_dir, step, 0)
    data = torch_load_checked(path, "cpu", mmap=True) if os.path.exists(path) else None
    return data.get("world_size", default) if isinstance(data, dict) else default


def _agree(error, checkpoint_dir):
    """Under a process group the ranks compare their results before any goes on: a fault on one rank raises on
    every rank, with the lowest failed rank's message, so that rank 0 reports it (a collective)."""
    if dist.is_initialized():
        failed_rank, message = first_failure(None if error is None else str(error))
        if error is None and failed_rank is not None:
            raise CheckpointError(message, checkpoint_dir)
    if error is not None:
        raise error


def load_shard_for_resume(checkpoint_dir, step, device, meta, world_size, rank=None):
    """This rank's optimizer shard of step `step` saved by `world_size` ranks (the number this run has), checked
    before anything trusts it: there, readable, and this rank's of that save by the run the meta records. Reads no
    other file. A collective under a process group (see _agree). rank: None = distributed.get_rank()."""
    rank = get_rank() if rank is None else rank
    data, error = None, None
    try:
        data = read_shard(checkpoint_dir, step, rank, world_size, meta.get("run_id"), device=device)
    except UserError as e:
        error = e
    _agree(error, checkpoint_dir)
    return data


def optimizer_states_for_resume(checkpoint_dir, step, device, meta, optimizers, rank=None, world_size=None):
    """The state_dicts this rank's `optimizers` load to continue step `step`: its own shard when the step was saved
    by as many ranks as this run has; else every saved shard, each checked, gathered and re-split for this rank
    (the shards are memory-mapped: a rank reads the matrices it now owns and the AdamW moments, not every rank's
    Muon state). Under a process group every rank calls it (faults agreed, see _agree). Returns (states, the
    world size that saved the step)."""
    rank = get_rank() if rank is None else rank
    world_size = (dist.get_world_size() if dist.is_initialized() else 1) if world_size is None else world_size
    saved = saved_world_size(checkpoint_dir, step, meta, world_size)
    if saved == world_size:
        return load_shard_for_resume(checkpoint_dir, step, device, meta, world_size, rank=rank)["optimizers"], saved
    states, error = None, None
    try:
        shards = [read_shard(checkpoint_dir, step, r, saved, meta.get("run_id"), device="cpu", mmap=True)["optimizers"]
                  for r in range(saved)]
        try:
            states = split_optimizer_states(gather_optimizer_states(shards, optimizers), optimizers, rank, world_size)
        except ValueError as e:
            raise CheckpointError(f"the optimizer shards of step {step} in {checkpoint_dir} do not fit this run's "
                                  f"optimizers: {e}", checkpoint_dir) from e
    except UserError as e:
        error = e
    _agree(error, checkpoint_dir)
    return states, saved  # on the CPU: load_state_dict moves each tensor to its parameter's device


# -----------------------------------------------------------------------------
# gathering and re-splitting


def _slots(optimizer, saved_groups):
    """(state index, parameter, kind, position in its group, group size) for every parameter of `optimizer`, with
    the state indices of the saved `param_groups` (torch numbers parameters group by group)."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{len(saved_groups)} saved param groups, {len(optimizer.param_groups)} in "
                         f"{type(optimizer).__name__}")
    default_kind = "muon" if isinstance(optimizer, Muon) else "adamw"
    for group, saved in zip(optimizer.param_groups, saved_groups):
        params = group["params"]
        if len(saved["params"]) != len(params):
            raise ValueError(f"a saved param group of {len(saved['params'])} parameters, {len(params)} in "
                             f"{type(optimizer).__name__}'s")
        kind = group.get("kind", default_kind)
        for j, (index, p) in enumerate(zip(saved["params"], params)):
            yield index, p, kind, j, len(params)


def _muon_owner(position, group_size, world_size):
    """The rank whose Muon state holds matrix `position` of a same-shaped group (nanochat.optim.muon.owned_matrices)."""
    return position // -(-group_size // world_size)


def _is_moment(value):
    return torch.is_tensor(value) and value.ndim > 0


def _as_int_step(value):
    return int(value.item()) if torch.is_tensor(value) else value


def gather_optimizer_states(shards, optimizers):
    """shards[r]: rank r's list of optimizer state_dicts, from a save by W = len(shards) ranks. Returns one
    state_dict per optimizer as a single process holds it: AdamW moments whole (shards concatenated along dim 0),
    every Muon matrix's state (from the rank that owned it), step counts as ints; param_groups as rank 0 saved
    them. `optimizers`: this run's (same model and recipe) for the parameters' shapes and kinds."""
    world_size = len(shards)
    gathered = []
    for k, optimizer in enumerate(optimizers):
        saved = [shard[k] for shard in shards]
        state = {}
        for index, p, kind, j, size in _slots(optimizer, saved[0]["param_groups"]):
            if kind == "muon":
                parts = [saved[_muon_owner(j, size, world_size)]["state"].get(index)]
            elif is_sharded(p, world_size):
                parts = [sd["state"].get(index) for sd in saved]
            else:
                parts = [saved[0]["state"].get(index)]
            if all(part is None for part in parts):
                continue  # never stepped
            if any(part is None for part in parts):
                raise ValueError(f"parameter {index} of {type(optimizer).__name__} has state on some ranks only")
            state[index] = {key: torch.cat([part[key] for part in parts]) if _is_moment(value) else _as_int_step(value)
                            for key, value in parts[0].items()}
        gathered.append({"state": state, "param_groups": saved[0]["param_groups"]})
    return gathered


def split_optimizer_states(gathered, optimizers, rank, world_size):
    """gather_optimizer_states' whole states cut for rank `rank` of `world_size`: the state_dicts that rank's
    `optimizers` load (their own tensors, not views of the gathered ones). Each group keeps the keys of this run's
    optimizer with the saved values (lr, initial_lr, betas, ...); torch's AdamW gets its step count as the float
    tensor it keeps, the other optimizers as an int."""
    states = []
    for optimizer, whole in zip(optimizers, gathered):
        tensor_step = isinstance(optimizer, torch.optim.AdamW)
        state = {}
        for index, p, kind, j, size in _slots(optimizer, whole["param_groups"]):
            if index not in whole["state"]:
                continue
            if kind == "muon" and _muon_owner(j, size, world_size) != rank:
                continue
            rows = slice(None)
            if kind == "adamw" and is_sharded(p, world_size):
                n = p.size(0) // world_size
                rows = slice(rank * n, (rank + 1) * n)
            state[index] = {key: value[rows].clone() if _is_moment(value) else
                            (torch.tensor(float(value), dtype=torch.float32) if tensor_step else value)
                            for key, value in whole["state"][index].items()}
        groups = [{**{key: saved.get(key, value) for key, value in group.items() if key != "params"},
                   "params": saved["params"]} for group, saved in zip(optimizer.param_groups, whole["param_groups"])]
        states.append({"state": state, "param_groups": groups})
    return states
