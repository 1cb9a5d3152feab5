"""
MuonAdamW: one optimizer for the whole model, as nanochat has it since July 2026 (the "2026-07" recipe,
nanochat 92d63d4): Muon for the 2D matrices of the transformer blocks, AdamW for everything else, each
param group saying which (kind='muon' | 'adamw') and carrying its own hyperparameters, including
per-group AdamW betas and weight decay.

The Muon step differs from the 2026-01 one (nanochat/optim/muon.py) in two places, marked * below:
  1. momentum:        buf = lerp(buf, G, 1 - momentum); g = lerp(G, buf, momentum)   (always Nesterov)
  2.*MuonEq:          scale every row of g to the RMS row norm ||g||_F / sqrt(rows), so the spectrum
                      entering the iteration is better conditioned (arXiv:2603.28254)
  3. orthogonalize:   O = PolarExpress(g), normalized by 1.01 ||g||_F (1.02 in 2026-01)
  4.*Muon+:           O = O * sqrt(min(rows, cols)) / ||O||_F, the norm of an exactly semi-orthogonal
                      matrix, which corrects for an under-converged iteration (arXiv:2602.21545)
  5. NorMuon, shape-scaled lr, cautious weight decay: as in 2026-01.
The AdamW step is torch.optim.AdamW's (nanochat/optim/adamw.py). Precision: the orthogonalization (2.-3.) runs
in `ortho_dtype`; momentum, the NorMuon statistic and everything after 3. stay in the weights' dtype.

The same class serves one process and torch.distributed (no DDP wrapper; it averages the gradients
itself): AdamW parameters are sharded ZeRO-2 style as in DistAdamW, Muon matrices are owned one per
rank as in DistMuon; all reductions are launched before the first update. Without a process group
every collective is a local copy. state_dict() holds this rank's shard; load it back with the same
world size. A parameter with no gradient contributes zeros and is still stepped.
"""

import torch

from nanochat.optim.adamw import adamw_shard_step_, launch_adamw_reduce
from nanochat.optim.muon import (cautious_step_, copy_gathered_matrices, init_muon_state, launch_matrix_gather,
                                 launch_matrix_grad_reduce, normalize_variance_, orthogonalize, owned_matrices,
                                 shape_lr_scale)
from nanochat.runtime.distributed import rank_and_world

ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
MUON_KEYS = ("lr", "momentum", "ns_steps", "beta2", "weight_decay")


def default_ortho_dtype_2026_07(device):
    """nanochat 2026-07 orthogonalizes in its compute dtype: bf16 on a CUDA GPU with native bf16 (SM 80+),
    fp32 anywhere else, CPUs included."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return torch.bfloat16
    return torch.float32


def muon_update_2026_07_(params, grads, states, lr, momentum, ns_steps, beta2, weight_decay, ortho_dtype):
    """Apply one 2026-07 Muon step in place to same-shaped matrices.

    params: list of B tensors (rows, cols); grads: (B, rows, cols), already averaged over ranks (not
    modified); states: list of B dicts holding 'momentum_buffer' and 'second_momentum_buffer' (both in
    the params' dtype)."""
    dtype = params[0].dtype
    rows, cols = params[0].shape
    for p, s in zip(params, states):
        init_muon_state(s, p, dtype)
    bufs = [s["momentum_buffer"] for s in states]

    # 1. Nesterov momentum
    torch._foreach_lerp_(bufs, list(grads.unbind(0)), 1 - momentum)
    g = grads.lerp(torch.stack(bufs), momentum)  # (B, rows, cols)

    # 2. MuonEq: equal row norms (measured in fp32), so no row dominates the spectrum being flattened
    X = g.to(ortho_dtype)
    target = X.float().norm(dim=(-2, -1), keepdim=True) / rows ** 0.5  # (B, 1, 1)
    row_norm = X.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (B, rows, 1)
    X = X * (target / row_norm).to(X.dtype)

    # 3. Polar Express, back to the weights' dtype for the rest
    O = orthogonalize(X, ns_steps, ortho_dtype, safety=1.01).to(dtype)

    # 4. Muon+: every singular value of an exact U V^T is 1, so ||U V^T||_F = sqrt(min(rows, cols))
    O = O * (min(rows, cols) ** 0.5 / O.float().norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6)).to(dtype)

    # 5. NorMuon, then the cautious update with the shape-scaled lr
    v = torch.stack([s["second_momentum_buffer"] for s in states])  # (B, rows, 1) or (B, 1, cols)
    O = normalize_variance_(O, v, beta2)
    torch._foreach_copy_([s["second_momentum_buffer"] for s in states], list(v.unbind(0)))
    lr_eff = lr * shape_lr_scale((rows, cols))
    for p, u in zip(params, O.unbind(0)):
        cautious_step_(p, u, lr_eff, weight_decay)


def split_param_groups(param_groups):
    """Validate param-group specs and split every Muon group by shape (its matrices are orthogonalized
    as one batch). Returns new group dicts, in the given order.

    Every group needs 'params' and 'kind'; an 'adamw' group needs ADAMW_KEYS, a 'muon' group MUON_KEYS
    and may have 'nesterov' (2026-01 only); 'initial_lr' is allowed. Anything else is refused, so a
    misspelt hyperparameter cannot fall back to a default."""
    out = []
    for i, group in enumerate(param_groups):
        kind = group.get("kind")
        if kind not in ("adamw", "muon"):
            raise ValueError(f"param group {i}: 'kind' must be 'adamw' or 'muon', got {kind!r}")
        required = ADAMW_KEYS if kind == "adamw" else MUON_KEYS
        missing = [k for k in required if k not in group]
        if missing:
            raise ValueError(f"param group {i} ({kind}) lacks {missing}; a {kind} group needs {list(required)}")
        allowed = {"params", "kind", "initial_lr", *required, *(("nesterov",) if kind == "muon" else ())}
        unknown = sorted(set(group) - allowed)
        if unknown:
            raise ValueError(f"param group {i} ({kind}) has unknown keys {unknown}; allowed: {sorted(allowed)}")
        params = list(group["params"])
        if not params:
            raise ValueError(f"param group {i} ({kind}) has no parameters")
        if kind == "adamw":
            out.append({**group, "params": params, "betas": tuple(group["betas"])})
            continue
        by_shape = {}
        for p in params:
            if p.ndim != 2:
                raise ValueError(f"param group {i} (muon): only 2D matrices, got a parameter of shape "
                                 f"{tuple(p.shape)}; put it in an adamw group")
            by_shape.setdefault(tuple(p.shape), []).append(p)
        out.extend({**group, "params": plist} for plist in by_shape.values())
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon + AdamW in one optimizer, single-process or distributed (see the module docstring).

    param_groups: dicts with 'params' and 'kind':
      kind='adamw': lr, betas, eps, weight_decay (decoupled: p *= 1 - lr * wd)
      kind='muon':  lr, momentum, ns_steps, beta2, weight_decay (cautious); 2D params only, split into
                    one group per shape here
    ortho_dtype: dtype of the orthogonalization; None picks default_ortho_dtype_2026_07(device), i.e.
    nanochat's rule; pass the run's compute dtype to tie them as nanochat does. Not saved in state_dict().
    Each group's 'lr' may be changed between steps."""

    def __init__(self, param_groups, ortho_dtype=None):
        groups = split_param_groups(param_groups)
        if any(not g.get("nesterov", True) for g in groups):
            raise ValueError("2026-07 Muon always uses Nesterov momentum; drop 'nesterov' from the muon groups")
        super().__init__(groups, defaults={})
        if ortho_dtype is None:
            ortho_dtype = default_ortho_dtype_2026_07(self.param_groups[0]["params"][0].device)
        if ortho_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"ortho_dtype must be torch.float32 or torch.bfloat16, got {ortho_dtype}")
        self.ortho_dtype = ortho_dtype

    @torch.no_grad()
    def step(self):
        rank, world = rank_and_world()
        # 1. launch every reduction: per parameter for AdamW, one stacked reduce-scatter per Muon group
        pending = []
        for group in self.param_groups:
            if group["kind"] == "adamw":
                pending.append([(p, *launch_adamw_reduce(p, world)) for p in group["params"]])
            else:
                pending.append(launch_matrix_grad_reduce(group["params"], world))

        # 2. in group order: wait for the group's reduction, update this rank's part, launch its gathers
        gathers = []  # (muon params or None, gathered stack or None, work)
        for group, reduced in zip(self.param_groups, pending):
            if group["kind"] == "adamw":
                for p, shard_grad, work in reduced:
                    work.wait()
                    gather = adamw_shard_step_(p, shard_grad, self.state[p], group, rank, world=world)
                    if gather is not None:
                        gathers.append((None, None, gather))
                continue
            owned_grads, work = reduced
            work.wait()
            params = group["params"]
            owned = owned_matrices(params, rank, world)
            if owned:
                muon_update_2026_07_(owned, owned_grads[:len(owned)].div_(world), [self.state[p] for p in owned],
                                     group["lr"], group["momentum"], ns_steps=group["ns_steps"], beta2=group["beta2"],
                                     weight_decay=group["weight_decay"], ortho_dtype=self.ortho_dtype)
            if world > 1:
                gathers.append((params, *launch_matrix_gather(params, owned, world)))

        # 3. every rank copies in the owners' matrices (AdamW shards were gathered in place)
        for params, recv, work in gathers:
            work.wait()
            if params is not None:
                copy_gathered_matrices(params, recv)


DistMuonAdamW = MuonAdamW  # nanochat's name for the distributed form; here one class serves one process and many
