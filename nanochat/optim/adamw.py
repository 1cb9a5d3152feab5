"""
DistAdamW: AdamW with ZeRO-2 style sharding, for torch.distributed without a DDP wrapper.

The update is torch.optim.AdamW's (bias-corrected moments, decoupled weight decay p *= 1 - lr*wd).
What differs is where it runs:
  - a parameter with >= 1024 elements whose dim 0 divides by the world size W is split along dim 0
    into W shards; its gradient is reduce-scattered so rank r receives the average gradient of shard r,
    updates only that shard (and keeps Adam moments only for it), then the shards are all-gathered;
  - smaller or non-divisible parameters (per-layer scalars, an odd vocab) are not worth the bookkeeping:
    their gradient is all-reduced (averaged, in place in .grad) and every rank updates the whole tensor.
Without a process group it is plain AdamW. state_dict() holds this rank's shard of the state; load it
back with the same world size. Works on NCCL and gloo (see nanochat/optim/muon.py for the collectives).
The per-parameter pieces (`launch_adamw_reduce`, `adamw_shard_step_`) also serve MuonAdamW.
"""

import torch

from nanochat.optim.muon import all_gather, all_reduce_sum, reduce_scatter_sum
from nanochat.runtime.distributed import rank_and_world

MIN_SHARD_NUMEL = 1024  # below this, a reduce-scatter + all-gather pair costs more than it saves


def adamw_update_(p, grad, state, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in place on p (a whole parameter or a shard of it), same math as torch.optim.AdamW
    and as both nanochat recipes (the denominator is sqrt(v / (1 - beta2^t)) + eps)."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    t = state["step"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    p.mul_(1 - lr * weight_decay)  # decoupled: the decay does not pass through the Adam normalization
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # the moments start at zero; dividing by (1 - beta^t) removes that bias during the first steps
    bias_correction1 = 1 - beta1 ** t
    bias_correction2 = 1 - beta2 ** t
    denom = (exp_avg_sq / bias_correction2).sqrt_().add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def is_sharded(p, world):
    """Whether `p` is split over the ranks (else its gradient is all-reduced and every rank updates it)."""
    return world > 1 and p.numel() >= MIN_SHARD_NUMEL and p.size(0) % world == 0


def launch_adamw_reduce(p, world):
    """Launch the reduction of p's gradient. Returns (shard_grad, work): after work.wait(), shard_grad is
    the SUM over ranks of the gradient of this rank's shard of p (all of p when not sharded)."""
    grad = torch.zeros_like(p) if p.grad is None else p.grad.contiguous()
    if is_sharded(p, world):
        shard_grad = torch.empty((p.size(0) // world, *p.shape[1:]), dtype=grad.dtype, device=grad.device)
        return shard_grad, reduce_scatter_sum(shard_grad, grad)
    return grad, all_reduce_sum(grad)


def adamw_shard_step_(p, shard_grad, state, group, rank, world):
    """Average the reduced gradient, update this rank's shard of p with the group's lr, betas, eps and
    weight_decay; for a sharded p, launch the all-gather of the shards and return its work (else None)."""
    shard_grad.div_(world)
    sharded = is_sharded(p, world)
    if sharded:
        rows = p.size(0) // world
        shard = p[rank * rows: (rank + 1) * rows]  # a view: updating it updates p
    else:
        shard = p
    beta1, beta2 = group["betas"]
    adamw_update_(shard, shard_grad, state, group["lr"], beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"])
    # in place: the input is p's own slice at offset rank * rows
    return all_gather(p, shard) if sharded else None


class DistAdamW(torch.optim.Optimizer):
    """ZeRO-2 AdamW (see the module docstring). Groups take lr, betas, eps, weight_decay; the RL loop
    may change a group's 'lr' between steps, and the model records 'initial_lr' on each group.
    A parameter with no gradient on a rank contributes zeros to the average and is still stepped."""

    def __init__(self, param_groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(param_groups, defaults)

    @torch.no_grad()
    def step(self):
        rank, world = rank_and_world()
        # 1. launch every gradient's reduction so communication overlaps the updates below
        pending = [(group, p, *launch_adamw_reduce(p, world)) for group in self.param_groups for p in group["params"]]

        # 2. average, update this rank's shard (or the whole small param), launch the all-gathers
        gathers = []
        for group, p, shard_grad, work in pending:
            work.wait()
            gather = adamw_shard_step_(p, shard_grad, self.state[p], group, rank, world=world)
            if gather is not None:
                gathers.append(gather)

        for work in gathers:
            work.wait()
