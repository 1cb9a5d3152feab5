"""
Muon: momentum + orthogonalized updates for the 2D weight matrices of the transformer blocks.

One step for a matrix parameter W (rows x cols) with gradient G:
  1. momentum:       buf = lerp(buf, G, 1 - momentum); g = lerp(G, buf, momentum) (Nesterov) or buf
  2. orthogonalize:  O = NewtonSchulz5(g), roughly U V^T for g = U S V^T (all singular values ~1)
  3. variance:       v = lerp(v, mean(O^2 over the smaller dim), 1 - beta2)   (NorMuon-style)
                     O = O / sqrt(v), then rescaled back to O's Frobenius norm before this step
  4. shape scale:    O = O * sqrt(max(1, rows / cols))
  5. cautious decay: W -= lr * wd * W * [O * W > 0]
  6. update:         W -= lr * O

`Muon` is the single-process optimizer. `DistMuon` is the same update under torch.distributed without
a DDP wrapper: it averages the gradients itself (reduce-scatter, so each rank receives the average of
the matrices it owns), the owner runs the update, and an all-gather hands the new weights to every
rank. It works on NCCL and on gloo (see `reduce_scatter_sum` for what gloo supports).

Parameters are grouped by shape (one param_group per shape) so that same-shaped matrices are
orthogonalized in one batched matmul chain. Each group's 'lr' may be changed between steps (the RL
loop schedules it); the model records 'initial_lr' on each group.
"""

import torch
import torch.distributed as dist

# Quintic Newton-Schulz coefficients (Keller Jordan's Muon). They are tuned for speed, not exact
# convergence: small singular values are pushed up fast (slope a = 3.4445 at 0), and after 5 steps every
# singular value sigma with sigma/||G||_F >= 1.6e-3 ends up in [0.68, 1.21] instead of exactly 1, which
# does not hurt training (tests/test_optim.py checks this band).
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(G, steps=5):
    """Approximate the orthogonal polar factor U V^T of G = U S V^T with a quintic Newton-Schulz iteration.

    G: (..., rows, cols), batched over leading dims. Runs in bf16 on CUDA (the iteration tolerates it
    and it halves the cost) and in fp32 elsewhere; returns G's dtype."""
    a, b, c = NS_COEFFS
    # The iteration maps each singular value s -> a*s + b*s^3 + c*s^5, which only behaves for s <= 1;
    # the Frobenius norm bounds the spectral norm, so dividing by it puts every singular value in [0, 1].
    X = G.float()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    X = X.to(torch.bfloat16 if X.is_cuda else torch.float32)
    # Work with the wide orientation so the Gram matrix X X^T is the smaller of the two.
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT  # (..., k, k) with k = min(rows, cols)
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def _reduced_dim(shape):
    """The dim the second moment averages over: the smaller one.

    After orthogonalization the vectors along the larger dim all have norm ~1 (rows of a wide O are
    orthonormal, columns of a tall O too), so a statistic per index of the smaller dim would be constant
    and do nothing; per index of the larger dim it varies and carries the variance information."""
    return -2 if shape[-2] <= shape[-1] else -1


def muon_update_(params, grads, states, lr, momentum, nesterov, ns_steps, beta2, weight_decay):
    """Apply one Muon step in place to same-shaped matrices. The math shared by Muon and DistMuon.

    params: list of B tensors (rows, cols); grads: (B, rows, cols), already averaged over ranks;
    states: list of B dicts (created on first use) holding 'momentum_buffer' and 'second_moment'."""
    rows, cols = params[0].shape
    red = _reduced_dim(params[0].shape)
    for p, s in zip(params, states):
        if not s:
            s["momentum_buffer"] = torch.zeros_like(p)
            vshape = (1, cols) if red == -2 else (rows, 1)
            s["second_moment"] = torch.zeros(vshape, dtype=torch.float32, device=p.device)
    bufs = [s["momentum_buffer"] for s in states]

    # 1. Momentum. Nesterov looks one step ahead along the buffer: the update mixes the fresh gradient
    # with the (just updated) buffer instead of using the buffer alone, which reacts faster.
    torch._foreach_lerp_(bufs, list(grads.unbind(0)), 1 - momentum)
    buf = torch.stack(bufs)  # (B, rows, cols)
    g = grads.lerp(buf, momentum) if nesterov else buf

    # 2. Orthogonalize: equalizes the update's singular values so rare directions get as much step as
    # the dominant ones (steepest descent under the spectral norm).
    O = orthogonalize(g, ns_steps).float()  # (B, rows, cols)

    # 3. NorMuon-style variance reduction: an Adam-like per-neuron second moment rescales rows/columns
    # whose updates have been large; restoring the Frobenius norm afterwards keeps Muon's step size,
    # so only the distribution of the step over neurons changes.
    v = torch.stack([s["second_moment"] for s in states])  # (B, 1, cols) or (B, rows, 1)
    v.lerp_(O.square().mean(dim=red, keepdim=True), 1 - beta2)
    for s, vi in zip(states, v.unbind(0)):
        s["second_moment"].copy_(vi)
    norm_before = O.norm(dim=(-2, -1), keepdim=True)
    O = O * v.clamp_min(1e-20).rsqrt()
    # clamp: an all-zero gradient gives O = 0 and must give a zero update, not 0/0.
    O = O * (norm_before / O.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-20))

    # 4. An orthogonalized (rows, cols) update has entries of RMS 1/sqrt(max(rows, cols)). For a tall
    # matrix (fan-out rows > fan-in cols) that is smaller than a square matrix of the same fan-in would
    # get; sqrt(rows/cols) brings it back to 1/sqrt(cols), so the step size follows the fan-in.
    O = O * max(1.0, rows / cols) ** 0.5

    # 5./6. Cautious weight decay: only shrink coordinates the update is already moving toward zero
    # (update and weight share a sign), so decay never fights the gradient direction.
    for i, p in enumerate(params):
        u = O[i].to(p.dtype)
        if weight_decay != 0:
            mask = (u * p) > 0
            p.sub_(lr * weight_decay * p * mask)
        p.sub_(lr * u)


def _split_by_shape(params, defaults):
    """Turn `params` (tensors or param-group dicts) into one param group per (group, shape)."""
    params = list(params)
    if not params:
        raise ValueError("Muon got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out = []
    for group in groups:
        by_shape = {}
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"Muon only takes 2D matrices, got a parameter of shape {tuple(p.shape)}; give it to AdamW")
            by_shape.setdefault(tuple(p.shape), []).append(p)
        for plist in by_shape.values():
            out.append({**defaults, **{k: v for k, v in group.items() if k != "params"}, "params": plist})
    return out


def _muon_defaults(lr, momentum, nesterov, ns_steps, beta2, weight_decay):
    return dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, beta2=beta2, weight_decay=weight_decay)


def _hyper(group):
    return {k: group[k] for k in ("lr", "momentum", "nesterov", "ns_steps", "beta2", "weight_decay")}


class Muon(torch.optim.Optimizer):
    """Single-process Muon for 2D matrices (see the module docstring for the algorithm).

    Parameters without a gradient are skipped."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, beta2=0.95, weight_decay=0.0):
        defaults = _muon_defaults(lr, momentum, nesterov, ns_steps, beta2, weight_decay)
        super().__init__(_split_by_shape(params, defaults), defaults)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = torch.stack([p.grad for p in params])
            muon_update_(params, grads, [self.state[p] for p in params], **_hyper(group))


# ---------------------------------------------------------------------------------------------------
# Collectives shared by the distributed optimizers (DistMuon here, DistAdamW in nanochat/adamw.py).
# One code path for NCCL and gloo: every call is async_op=True and the caller waits on work.wait().
# Work.get_future() is avoided because gloo's reduce-scatter work does not implement it
# ("Work::getFuture not implemented"). Gradients are summed then divided by the world size because
# ReduceOp.AVG is NCCL-only on older torch versions.


class _Done:
    """Stand-in for a finished Work when there is no process group (world size 1)."""

    def wait(self):
        return True


def dist_world():
    """(rank, world_size), (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def reduce_scatter_sum(output, input):
    """Async sum-reduce-scatter along dim 0: rank r gets sum over ranks of input's r-th chunk.

    gloo has no native reduce-scatter; since torch 2.3 it emulates reduce_scatter_tensor with an
    all-reduce (2x the traffic, fine for CPU runs). torch 2.13 renamed it reduce_scatter_single."""
    if dist_world()[1] == 1:
        output.copy_(input)
        return _Done()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, async_op=True)


def all_gather(output, input):
    """Async all-gather along dim 0: output = cat of every rank's input. `input` may be output's own
    slice at rank * len(input) (in place; NCCL documents this, gloo handles it)."""
    if dist_world()[1] == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, async_op=True)


def all_reduce_sum(tensor):
    """Async in-place sum over ranks."""
    if dist_world()[1] == 1:
        return _Done()
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)


class DistMuon(torch.optim.Optimizer):
    """Muon under torch.distributed without DDP: gradients are averaged here, not by a wrapper.

    Within each shape group of B matrices, padded to P = ceil(B / W) * W slots, rank r owns the
    contiguous slots [r * P/W, (r+1) * P/W) (slots >= B are padding). A step:
      1. stack the local grads (P, rows, cols) and reduce-scatter: each rank receives the summed grads
         of the matrices it owns, and divides by W;
      2. the owner runs the Muon update on its matrices (state lives only on the owner);
      3. all-gather the owners' new weights into every rank's copy.
    All groups' reduce-scatters are launched before the first update so communication overlaps compute.
    Without a process group it behaves exactly like Muon. A parameter with no gradient on a rank
    contributes zeros to the average (it is still stepped: ranks cannot skip a collective alone).
    state_dict() holds only this rank's shard; load it back with the same world size.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, beta2=0.95, weight_decay=0.0):
        defaults = _muon_defaults(lr, momentum, nesterov, ns_steps, beta2, weight_decay)
        super().__init__(_split_by_shape(params, defaults), defaults)

    @torch.no_grad()
    def step(self):
        rank, world = dist_world()
        # 1. launch every group's reduce-scatter
        pending = []
        for group in self.param_groups:
            params = group["params"]
            per_rank = -(-len(params) // world)
            p0 = params[0]
            stacked = torch.zeros((per_rank * world, *p0.shape), dtype=p0.dtype, device=p0.device)
            for i, p in enumerate(params):
                if p.grad is not None:
                    stacked[i].copy_(p.grad)
            owned_grads = torch.empty((per_rank, *p0.shape), dtype=p0.dtype, device=p0.device)
            pending.append((group, per_rank, owned_grads, reduce_scatter_sum(owned_grads, stacked)))

        # 2. update owned matrices, launch the all-gather of new weights
        gathers = []
        for group, per_rank, owned_grads, work in pending:
            work.wait()
            params = group["params"]
            owned = params[rank * per_rank: (rank + 1) * per_rank]  # may be short or empty (padding)
            if owned:
                grads = owned_grads[: len(owned)].div_(world)
                muon_update_(owned, grads, [self.state[p] for p in owned], **_hyper(group))
            send = torch.zeros_like(owned_grads)
            for i, p in enumerate(owned):
                send[i].copy_(p)
            recv = torch.empty((per_rank * world, *send.shape[1:]), dtype=send.dtype, device=send.device)
            gathers.append((params, recv, all_gather(recv, send)))

        # 3. every rank copies in the owners' weights
        for params, recv, work in gathers:
            work.wait()
            for i, p in enumerate(params):
                p.copy_(recv[i])
