"""
What a rank asks of the process group: its rank and the world's size, its share of the items, and the collectives
every rank calls at the same point (a flag on any rank, a mean over ranks), and how the group is torn down after a
good end or an error. The group itself is set up by nanochat.common.compute_init.
"""

import gc
import os

import torch
import torch.distributed as dist


def rank_and_world():
    """(rank, world_size) of this process: the process group's once it is up, else what torchrun set in
    RANK and WORLD_SIZE (before compute_init, e.g. for a validation error), else (0, 1). The environment
    counts only when it is a whole torchrun launch (is_ddp_launch), the rule compute_init follows: a launcher
    that sets RANK without LOCAL_RANK runs one process, which must then save, evaluate and step as rank 0.
    The one place the library learns its rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if is_ddp_launch():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def get_rank():
    return rank_and_world()[0]


def print0(*args, **kwargs):
    """print() on rank 0 only."""
    if get_rank() == 0:
        print(*args, **kwargs, flush=True)


def is_ddp_launch():
    """True when launched by torchrun (which sets RANK, LOCAL_RANK and WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def get_dist_info():
    """(is_ddp, rank, local_rank, world_size) of a torchrun launch; (False, 0, 0, 1) otherwise."""
    if is_ddp_launch():
        rank, world_size = rank_and_world()
        return True, rank, int(os.environ["LOCAL_RANK"]), world_size
    return False, 0, 0, 1


def rank_share(start, stop, rank, world_size):
    """This rank's share of the items start..stop-1: every world_size-th one from start + rank, so the ranks
    together cover each item once (the split of RL questions, eval questions and SFT examples)."""
    return range(start + rank, stop, world_size)


def wait_for_all_ranks():
    """At the end of a run that ended well, before compute_cleanup: no rank tears the process group down while
    another (rank 0 writing its report or checkpoint) is still at work. A rank that left first was aborted by gloo
    at exit ("terminate called without an active exception": chat_eval's 2-rank test, 2 of 16 runs; 0 of 20 with
    the barrier). Not on an error path: a rank that failed alone would wait there for ever."""
    if dist.is_initialized():
        dist.barrier()


def cleanup_after_error():
    """Tear down a gloo process group, if any, on an error path: without wait_for_all_ranks' barrier (a rank that
    failed alone would wait there for ever). A process that exited with its group alive left gloo's threads to the
    interpreter's exit, which now and then aborted it ("terminate called without an active exception", exit code
    -6 instead of the error's 2; a 2-rank --resume refused on both ranks, once in a loaded test run). Not NCCL's:
    its teardown can wait for a collective that a rank which failed alone will never join."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            release_process_group()
        except Exception:  # already broken (a peer gone): the exit code must still be the error's
            pass


def release_process_group():
    """destroy_process_group, after a collection: gloo's work objects caught in reference cycles (a distributed
    optimizer's) still hold tensors, and freed during the interpreter's exit they take the GIL from a dying
    interpreter, which aborts the process ("terminate called without an active exception"; pytorch#179291)."""
    gc.collect()
    dist.destroy_process_group()


def collective_device(device):
    """Where a tensor that ranks reduce together must live: the rank's CUDA device (NCCL reduces CUDA tensors
    only), else the CPU (gloo)."""
    device = torch.device(device)
    return device if device.type == "cuda" else torch.device("cpu")


def reduction_dtype(device):
    """The dtype of sums reduced across ranks: float64 on the CPU, float32 on a GPU. Decided by the device's
    type, so torch.device("cpu") and "cpu" get the same precision."""
    return torch.float64 if torch.device(device).type == "cpu" else torch.float32


def any_rank(flag, device="cpu"):
    """Whether `flag` (a bool) holds on any rank (itself without a process group): every rank must call it at the
    same point. `device`: see collective_device."""
    value = torch.tensor([int(flag)], device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_reduce_mean(x, device="cpu"):
    """Average a python float or tensor over ranks (identity without a process group).
    `device`: see collective_device."""
    t = torch.as_tensor(x, dtype=reduction_dtype(device), device=device).clone()
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t.item() if t.numel() == 1 else t
