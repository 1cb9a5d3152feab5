"""
The optimizers of a nanochat recipe, built from one list of param-group specs.

  recipe     nanochat          optimizers (one process)            with a process group
  "2026-01"  7312ec9, Jan 2026 [torch AdamW(fused), Muon]          [DistAdamW, DistMuon]
  "2026-07"  92d63d4, Jul 2026 [MuonAdamW]                         [MuonAdamW] (it shards itself)

The specs are the same for both recipes: which parameters go to AdamW and which to Muon, with the
hyperparameters of each group (see `build_optimizers`). Which lr and betas each kind of parameter gets
in each recipe is nanochat/optim/param_groups.py's business; the fixtures in tests/fixtures/optimizer
record nanochat's choices, and tests/optim/test_optim.py replays them against nanochat's own steps.

Also the schedule every stage shares (init_lr_frac, then nanochat's linear decay to 0, or chat_rl's
--lr-schedule) and the step guarded by the finite check (with an fp16 run's loss scale folded into it).
"""

import math

import torch
import torch.distributed as dist

from nanochat.errors import SettingError
from nanochat.optim.adamw import DistAdamW
from nanochat.optim.muon import DistMuon, Muon
from nanochat.optim.muon_adamw import MuonAdamW, split_param_groups

RECIPES = ("2026-01", "2026-07")


def build_optimizers(recipe, param_groups, ortho_dtype=None):
    """The list of optimizers of `recipe` over `param_groups`; step every one of them each step.

    param_groups: list of dicts, each with 'params' (tensors) and 'kind':
      kind='adamw': lr, betas, eps, weight_decay (decoupled weight decay, per group)
      kind='muon':  lr, momentum, ns_steps, beta2, weight_decay (cautious), optionally nesterov (2026-01
                    only; default True); 2D parameters only
    Missing or unknown keys raise ValueError. A parameter may appear in one group only.
    ortho_dtype: dtype of Muon's orthogonalization (torch.bfloat16 or torch.float32). None takes the
    recipe's rule: 2026-01 bf16 where the device multiplies bf16 natively (CUDA, AVX512-BF16/AMX CPUs),
    else fp32; 2026-07 bf16 on CUDA SM 80+, else fp32 (nanochat ties it to its compute dtype, so pass
    the run's compute dtype to follow a --dtype choice).
    With an initialized process group the distributed versions are used (they average the gradients
    themselves: do not wrap the model in DDP). Every group gets 'initial_lr' = its 'lr'."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown optimizer recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    groups = split_param_groups(param_groups)
    seen = set()
    for group in groups:
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is in more than one param group")
            seen.add(id(p))

    if recipe == "2026-07":
        optimizers = [MuonAdamW(groups, ortho_dtype=ortho_dtype)]
    else:
        adam_groups = [g for g in groups if g["kind"] == "adamw"]
        muon_groups = [g for g in groups if g["kind"] == "muon"]
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            adamw = DistAdamW(adam_groups)
            muon = DistMuon(muon_groups, ortho_dtype=ortho_dtype)
        else:
            # nanochat's fused kernel (CPU and CUDA); elsewhere (mps) torch's default implementation
            fused = all(p.device.type in ("cpu", "cuda") for g in adam_groups for p in g["params"]) or None
            adamw = torch.optim.AdamW(adam_groups, fused=fused)
            muon = Muon(muon_groups, ortho_dtype=ortho_dtype)
        optimizers = [adamw, muon]

    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def scale_initial_lr(optimizers, init_lr_frac):
    """Start every param group at init_lr_frac of its lr and record that as the group's `initial_lr`, which
    the schedule multiplies by lrm (nanochat's init_lr_frac). Returns the optimizers."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * init_lr_frac
            group["initial_lr"] = group["lr"]
    return optimizers


LR_SCHEDULES = ("linear", "constant", "cosine")


def lr_multiplier(step, num_steps, schedule="linear", warmup_steps=0, final_lr_frac=0.0):
    """What every group's initial_lr is multiplied by at `step` of `num_steps` (lrm). The defaults are nanochat's
    linear decay from 1 at step 0 to 0 at num_steps, 1 - step/num_steps, to the last bit. Otherwise:
      warm-up, step < warmup_steps:  (step + 1) / warmup_steps            (as nanochat's base training)
      after it, with t = (step - warmup_steps) / (num_steps - warmup_steps), from 0 to 1 at num_steps:
        linear:    1 - t * (1 - final_lr_frac)
        constant:  1
        cosine:    final_lr_frac + (1 - final_lr_frac) * (1 + cos(pi * t)) / 2"""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    t = (step - warmup_steps) / (num_steps - warmup_steps)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return final_lr_frac + (1 - final_lr_frac) * (1 + math.cos(math.pi * t)) / 2
    return 1.0 - t * (1.0 - final_lr_frac)


def all_ranks_finite(values, device="cpu"):
    """True when every value is finite on every rank. Under a process group this is one all-reduce (MIN), so
    every rank gets the same answer: the distributed optimizers' collectives need all ranks to step or none.
    device: a tensor device the process group reduces (the rank's CUDA device under NCCL)."""
    return all_ranks_finite_each([values], device)[0]


def all_ranks_finite_each(groups, device="cpu"):
    """For each group of values (python floats), whether all of them are finite on every rank: one all-reduce (MIN)
    for all the groups, the same answers on every rank (see all_ranks_finite)."""
    finite = torch.tensor([float(all(math.isfinite(v) for v in values)) for values in groups], device=device)
    if dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return [f == 1.0 for f in finite.tolist()]


def grad_norm(model):
    """L2 norm of this rank's gradients (before the distributed optimizers average them); inf/nan if any is."""
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item() if norms else 0.0


def guarded_step(model, optimizers, lrm, loss, device="cpu", loss_scale=None):
    """The optimizer step of chat_rl and chat_sft: every group's lr = initial_lr * lrm, then one step of each
    optimizer, but only when the loss and the gradient are finite on every rank; the gradients are cleared
    either way. loss: this rank's loss or objective (python float).
    loss_scale: an fp16 run's LossScale (nanochat/optim/loss_scale.py), whose scale the gradients were
    backpropagated with: they are unscaled first, and the scale is updated from the same check across ranks, so a
    gradient that overflowed on one rank skips the step on every rank and backs the scale off everywhere.
    Returns (this rank's grad norm, unscaled; stepped)."""
    if loss_scale is not None:
        loss_scale.unscale_(model)
    gnorm = grad_norm(model)
    loss_finite, grad_finite = all_ranks_finite_each([[loss], [gnorm]], device)
    stepped = loss_finite and grad_finite
    if loss_scale is not None:
        if loss_finite:
            loss_scale.update(found_inf=not grad_finite)
        else:  # skipped for its loss: neither a good step towards the scale's growth nor an overflow to back off from
            loss_scale.hold()
    if stepped:
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lrm
        for opt in optimizers:
            opt.step()
    model.zero_grad(set_to_none=True)
    return gnorm, stepped


def check_optimizer_flags(args):
    """Refuse a negative learning rate or weight decay (settings of the flags nanochat.cli.add_optimizer_flags
    declares; a SettingError, which the command line shows under the flag's name)."""
    for name in ("embedding_lr", "unembedding_lr", "matrix_lr", "weight_decay"):
        if getattr(args, name) < 0:
            raise SettingError(name, f"must be >= 0, got {getattr(args, name)}")
