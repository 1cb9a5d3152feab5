"""
Muon: momentum + orthogonalized updates for the 2D weight matrices of the transformer blocks, as
nanochat had it in January 2026 (the "2026-01" recipe, nanochat 7312ec9). The 2026-07 variant, fused
with AdamW into one optimizer, is in nanochat/optim/muon_adamw.py and reuses the pieces below.

One step for a matrix parameter W (rows x cols) with gradient G:
  1. momentum:        buf = lerp(buf, G, 1 - momentum); g = lerp(G, buf, momentum) (Nesterov) or buf
  2. orthogonalize:   O = PolarExpress(g), close to U V^T for g = U S V^T (5 tuned odd quintics)
  3. variance:        v = lerp(v, mean(O^2 along the longer dim), 1 - beta2)   (NorMuon)
                      O = O / sqrt(v), then rescaled back to O's Frobenius norm before this step
  4. shape-scaled lr: lr_eff = lr * sqrt(max(1, rows / cols))
  5. cautious decay:  W -= lr_eff * (O + wd * W * [O * W >= 0])

`Muon` is the single-process optimizer. `DistMuon` is the same update under torch.distributed without
a DDP wrapper: it averages the gradients itself (reduce-scatter, so each rank receives the average of
the matrices it owns), the owner runs the update, and an all-gather hands the new weights to every
rank. It works on NCCL and on gloo (see `reduce_scatter_sum` for what gloo supports).

Precision: nanochat orthogonalizes in bf16 (the whole iteration, including the normalizing norm) and
keeps the NorMuon buffer and the update in bf16; the weights and the momentum stay fp32. On a device
without native bf16 matmuls (an AVX2-only CPU) that is ~100x slower than fp32, so there the default is
fp32; `ortho_dtype=torch.bfloat16` forces nanochat's numerics anywhere (see `default_ortho_dtype`).

Parameters are grouped by shape (one param_group per shape) so that same-shaped matrices are
orthogonalized in one batched matmul chain. Each group's 'lr' may be changed between steps (the RL
loop schedules it); the model records 'initial_lr' on each group.
"""

import torch
import torch.distributed as dist

from nanochat.runtime.cpu_features import cpu_has_native_bf16
from nanochat.runtime.distributed import rank_and_world

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one odd quintic
# x -> a x + b x^3 + c x^5 per iteration, each chosen minimax-optimal for where the singular values can
# be after the previous ones (5 iterations, safety factor 2e-2, cushion 2). Unlike a fixed Newton-Schulz
# quintic they drive every singular value above ~1e-3 of the largest to within a few percent of 1.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def default_ortho_dtype(device):
    """The dtype Muon orthogonalizes in on `device` unless told otherwise: bf16 where the device
    multiplies bf16 natively (CUDA; CPUs with AVX512-BF16 or AMX), as nanochat does, fp32 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def orthogonalize(G, steps=5, dtype=torch.float32, safety=1.02):
    """Approximate the orthogonal polar factor U V^T of G = U S V^T with Polar Express.

    G: (..., rows, cols), batched over leading dims. Everything (the cast comes first, then the
    normalizing norm and the iteration) runs in `dtype`, and the result is returned in `dtype`.
    `safety`: the Frobenius norm is inflated by this factor before the iteration (nanochat: 1.02 in
    2026-01, 1.01 in 2026-07)."""
    if steps > len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"Polar Express has coefficients for at most {len(POLAR_EXPRESS_COEFFS)} steps, got ns_steps={steps}")
    X = G.to(dtype)
    # Work with the wide orientation so the Gram matrix X X^T is the smaller of the two.
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    # The polynomials are designed for singular values in [0, 1]; the Frobenius norm bounds the spectral
    # norm, and the safety factor keeps rounding (bf16) from pushing the largest one just past 1.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * safety + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        A = X @ X.mT  # (..., k, k) with k = min(rows, cols)
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X


def second_moment_shape(shape):
    """Shape of the NorMuon statistic of a (rows, cols) matrix: one per row when rows >= cols, else
    one per column, i.e. one per index of the longer dim (nanochat's rule; square matrices get rows).

    After orthogonalization the vectors along the shorter dim are orthonormal, so the mean square over
    the longer dim is what varies from neuron to neuron and carries the variance information."""
    rows, cols = shape[-2:]
    return (rows, 1) if rows >= cols else (1, cols)


def normalize_variance_(O, v, beta2):
    """NorMuon: update the running per-neuron mean square `v` with O's and return O / sqrt(v), rescaled
    to O's Frobenius norm, so only how the step is spread over neurons changes, not its size.

    O: (B, rows, cols) in the orthogonalization dtype; v: (B, rows, 1) or (B, 1, cols), updated in place
    (in its own dtype: bf16 in nanochat's 2026-01 numerics). The means and norms are taken in fp32; the
    final scale is rounded to O's dtype before it multiplies O, as nanochat does."""
    red = -1 if v.size(-1) == 1 else -2
    n = O.size(red)
    mean_sq = O.float().square().mean(dim=red, keepdim=True)  # shaped like v
    norm = (mean_sq.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    v.lerp_(mean_sq.to(v.dtype), 1 - beta2)
    inv_rms = v.clamp_min(1e-10).rsqrt()
    # ||O / sqrt(v)||_F from the per-neuron sums, without a second pass over O
    new_norm = (mean_sq * n * inv_rms.float().square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    # clamp: an all-zero gradient gives O = 0 and must give a zero update, not 0/0
    return O * (inv_rms * (norm / new_norm.clamp_min(1e-10))).to(O.dtype)


def shape_lr_scale(shape):
    """An orthogonalized (rows, cols) update has entries of RMS 1/sqrt(max(rows, cols)). For a tall
    matrix (fan-out rows > fan-in cols) that is smaller than a square matrix of the same fan-in would
    get; sqrt(rows/cols) brings it back to 1/sqrt(cols), so the step size follows the fan-in."""
    rows, cols = shape[-2:]
    return max(1.0, rows / cols) ** 0.5


def cautious_step_(p, u, lr, weight_decay):
    """p -= lr * (u + weight_decay * p * [u * p >= 0]).

    Cautious weight decay: decay only the coordinates the update already moves toward zero (update and
    weight share a sign, or either is 0), so the decay never fights the gradient. `lr` is the same
    shape-scaled lr as the update's. u may be bf16: lr * u is then rounded to bf16, as in nanochat."""
    if weight_decay != 0:
        mask = (u * p) >= 0
        p.sub_(lr * u + lr * weight_decay * p * mask)
    else:
        p.sub_(lr * u)


def init_muon_state(state, p, buffer_dtype):
    """Create the missing buffers of one matrix's Muon state. A state saved before the NorMuon statistic
    moved to nanochat's orientation (key 'second_moment') gets a fresh one; a buffer loaded back in the
    parameter's dtype (torch's load_state_dict casts) is returned to `buffer_dtype`."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    v = state.get("second_momentum_buffer")
    if v is None:
        state["second_momentum_buffer"] = torch.zeros(second_moment_shape(p.shape), dtype=buffer_dtype, device=p.device)
    elif v.dtype != buffer_dtype:
        state["second_momentum_buffer"] = v.to(buffer_dtype)


def muon_update_(params, grads, states, lr, momentum, nesterov, ns_steps, beta2, weight_decay, ortho_dtype):
    """Apply one 2026-01 Muon step in place to same-shaped matrices. The math shared by Muon and DistMuon.

    params: list of B tensors (rows, cols); grads: (B, rows, cols), already averaged over ranks (not
    modified); states: list of B dicts holding 'momentum_buffer' (params' dtype) and
    'second_momentum_buffer' (ortho_dtype); beta2=None turns NorMuon off."""
    for p, s in zip(params, states):
        init_muon_state(s, p, ortho_dtype)
    bufs = [s["momentum_buffer"] for s in states]

    # 1. Momentum. Nesterov looks one step ahead along the buffer: the update mixes the fresh gradient
    # with the (just updated) buffer instead of using the buffer alone, which reacts faster.
    torch._foreach_lerp_(bufs, list(grads.unbind(0)), 1 - momentum)
    buf = torch.stack(bufs)  # (B, rows, cols)
    g = grads.lerp(buf, momentum) if nesterov else buf

    # 2. Orthogonalize: equalizes the update's singular values so rare directions get as much step as
    # the dominant ones (steepest descent under the spectral norm).
    O = orthogonalize(g, ns_steps, ortho_dtype)  # (B, rows, cols), ortho_dtype

    # 3. NorMuon (the statistics live one tensor per matrix; they are stacked for the batched math)
    if beta2 is not None:
        v = torch.stack([s["second_momentum_buffer"] for s in states])  # (B, rows, 1) or (B, 1, cols)
        O = normalize_variance_(O, v, beta2)
        torch._foreach_copy_([s["second_momentum_buffer"] for s in states], list(v.unbind(0)))

    # 4./5.
    lr_eff = lr * shape_lr_scale(params[0].shape)
    for p, u in zip(params, O.unbind(0)):
        cautious_step_(p, u, lr_eff, weight_decay)


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


def _resolve_ortho_dtype(ortho_dtype, param_groups):
    if ortho_dtype is None:
        return default_ortho_dtype(param_groups[0]["params"][0].device)
    if ortho_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"ortho_dtype must be torch.float32 or torch.bfloat16, got {ortho_dtype} "
                         f"(fp16's exponent range is too small for the iteration)")
    return ortho_dtype


class Muon(torch.optim.Optimizer):
    """Single-process Muon for 2D matrices (see the module docstring for the algorithm).

    ortho_dtype: the dtype of the orthogonalization and of the NorMuon statistic; None picks
    default_ortho_dtype(device of the parameters). It is a property of this machine, not of the run,
    so it is not saved in state_dict(). Parameters without a gradient are skipped."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, beta2=0.95, weight_decay=0.0,
                 ortho_dtype=None):
        defaults = _muon_defaults(lr, momentum, nesterov, ns_steps, beta2, weight_decay=weight_decay)
        super().__init__(_split_by_shape(params, defaults), defaults)
        self.ortho_dtype = _resolve_ortho_dtype(ortho_dtype, self.param_groups)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = torch.stack([p.grad for p in params])
            muon_update_(params, grads, [self.state[p] for p in params], **_hyper(group), ortho_dtype=self.ortho_dtype)


# ---------------------------------------------------------------------------------------------------
# Collectives shared by the distributed optimizers (DistMuon here, DistAdamW in nanochat/optim/adamw.py,
# MuonAdamW in nanochat/optim/muon_adamw.py). One code path for NCCL and gloo: every call is async_op=True
# and the caller waits on work.wait(). Work.get_future() is avoided because gloo's reduce-scatter work
# does not implement it ("Work::getFuture not implemented"). Gradients are summed then divided by the
# world size because ReduceOp.AVG is NCCL-only on older torch versions.


class _Done:
    """Stand-in for a finished Work when there is no process group (world size 1)."""

    def wait(self):
        return True


def reduce_scatter_sum(output, input):
    """Async sum-reduce-scatter along dim 0: rank r gets sum over ranks of input's r-th chunk.

    gloo has no native reduce-scatter; since torch 2.3 it emulates reduce_scatter_tensor with an
    all-reduce (2x the traffic, fine for CPU runs). torch 2.13 renamed it reduce_scatter_single."""
    if rank_and_world()[1] == 1:
        output.copy_(input)
        return _Done()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM, async_op=True)


def all_gather(output, input):
    """Async all-gather along dim 0: output = cat of every rank's input. `input` may be output's own
    slice at rank * len(input) (in place; NCCL documents this, gloo handles it)."""
    if rank_and_world()[1] == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return _Done()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, async_op=True)


def all_reduce_sum(tensor):
    """Async in-place sum over ranks."""
    if rank_and_world()[1] == 1:
        return _Done()
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)


# Sharding a group of B same-shaped matrices over W ranks: padded to P = ceil(B / W) * W slots, rank r
# owns the contiguous slots [r * P/W, (r+1) * P/W) (slots >= B are padding).


def owned_matrices(params, rank, world):
    """The matrices of a same-shaped group that `rank` updates (may be short or empty: padding)."""
    per_rank = -(-len(params) // world)
    return params[rank * per_rank: (rank + 1) * per_rank]


def launch_matrix_grad_reduce(params, world):
    """Launch the reduce-scatter of a same-shaped group's gradients. Returns (owned_grads, work): after
    work.wait(), owned_grads[i] (P/W, rows, cols) is the SUM over ranks of the gradient of this rank's
    i-th owned matrix (divide by W). A missing gradient contributes zeros."""
    per_rank = -(-len(params) // world)
    p0 = params[0]
    stacked = torch.zeros((per_rank * world, *p0.shape), dtype=p0.dtype, device=p0.device)
    for i, p in enumerate(params):
        if p.grad is not None:
            stacked[i].copy_(p.grad)
    owned_grads = torch.empty((per_rank, *p0.shape), dtype=p0.dtype, device=p0.device)
    return owned_grads, reduce_scatter_sum(owned_grads, stacked)


def launch_matrix_gather(params, owned, world):
    """Launch the all-gather of the owners' new weights. Returns (recv, work); after work.wait(),
    `copy_gathered_matrices(params, recv)` writes them into every rank's parameters."""
    per_rank = -(-len(params) // world)
    p0 = params[0]
    send = torch.zeros((per_rank, *p0.shape), dtype=p0.dtype, device=p0.device)
    for i, p in enumerate(owned):
        send[i].copy_(p)
    recv = torch.empty((per_rank * world, *p0.shape), dtype=p0.dtype, device=p0.device)
    return recv, all_gather(recv, send)


def copy_gathered_matrices(params, recv):
    torch._foreach_copy_(list(params), list(recv[:len(params)].unbind(0)))


class DistMuon(Muon):
    """Muon under torch.distributed without DDP: gradients are averaged here, not by a wrapper.

    Within each shape group every matrix has one owner rank (see `owned_matrices`). A step:
      1. stack the local grads and reduce-scatter: each rank receives the summed grads of the matrices
         it owns, and divides by W;
      2. the owner runs the Muon update on its matrices (state lives only on the owner);
      3. all-gather the owners' new weights into every rank's copy.
    All groups' reduce-scatters are launched before the first update so communication overlaps compute.
    Without a process group it behaves exactly like Muon. A parameter with no gradient on a rank
    contributes zeros to the average (it is still stepped: ranks cannot skip a collective alone).
    state_dict() holds only this rank's shard; load it back with the same world size.
    The constructor and its arguments are Muon's; only the step differs.
    """

    @torch.no_grad()
    def step(self):
        rank, world = rank_and_world()
        # 1. launch every group's reduce-scatter
        pending = [(group, *launch_matrix_grad_reduce(group["params"], world)) for group in self.param_groups]

        # 2. update owned matrices, launch the all-gather of new weights
        gathers = []
        for group, owned_grads, work in pending:
            work.wait()
            params = group["params"]
            owned = owned_matrices(params, rank, world)
            if owned:
                grads = owned_grads[: len(owned)].div_(world)
                muon_update_(owned, grads, [self.state[p] for p in owned], **_hyper(group), ortho_dtype=self.ortho_dtype)
            gathers.append((params, *launch_matrix_gather(params, owned, world)))

        # 3. every rank copies in the owners' weights
        for params, recv, work in gathers:
            work.wait()
            copy_gathered_matrices(params, recv)
