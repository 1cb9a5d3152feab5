"""Tests for nanochat/muon.py and nanochat/adamw.py: the orthogonalization's spectrum, Muon against an
independent step-by-step implementation and a hand-computed case, cautious weight decay, state_dict
resume, and DistMuon / DistAdamW on 2 gloo processes against the single-process optimizers."""

import importlib.util
import io
import math
from pathlib import Path

import pytest
import torch

from nanochat.adamw import DistAdamW
from nanochat.muon import NS_COEFFS, DistMuon, Muon, orthogonalize
from gloo_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]


def _load_worker():
    spec = importlib.util.spec_from_file_location("dist_optim_worker", Path(__file__).with_name("dist_optim_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _load_worker()


def ns5_scalar(s):
    """What 5 quintic Newton-Schulz steps do to one singular value s of the normalized matrix."""
    a, b, c = NS_COEFFS
    for _ in range(5):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


# The band of these coefficients after 5 steps (computed on a 2M-point grid of s = sigma / ||G||_F):
# every s in [1.6e-3, 1] lands in [0.68, 1.21]; smaller s are multiplied by ~a^5 = 484 and stay below.
NS_BAND = (0.68, 1.21)
NS_BAND_MIN_S = 1.6e-3


def test_ns_band_of_the_scalar_map():
    s = torch.linspace(NS_BAND_MIN_S, 1.0, 200_001, dtype=torch.float64)
    y = ns5_scalar(s)
    assert NS_BAND[0] <= y.min() and y.max() <= NS_BAND[1]


@pytest.mark.parametrize("shape", [(64, 64), (64, 256), (256, 64)])
def test_orthogonalize_singular_values(shape):
    """O = NS(G) keeps G's singular vectors and maps each singular value through the scalar map:
    ||O v_i|| = ns5(sigma_i / ||G||_F); those not vanishingly small end up in the band."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.float32)
    O = orthogonalize(G)
    assert O.shape == G.shape and O.dtype == torch.float32
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    s = S / G.double().norm()
    gains = (O.double() @ Vh.T).norm(dim=0)  # ||O v_i|| for each right singular vector v_i
    torch.testing.assert_close(gains, ns5_scalar(s), atol=1e-4, rtol=0)
    in_band = s >= NS_BAND_MIN_S
    assert in_band.sum() >= min(shape) - 2  # a square Gaussian matrix may have one or two tiny ones
    assert ((gains[in_band] >= NS_BAND[0]) & (gains[in_band] <= NS_BAND[1])).all()
    assert (gains[~in_band] < NS_BAND[1]).all() and (gains[~in_band] > s[~in_band]).all()
    if shape[0] != shape[1]:  # a rectangular Gaussian matrix is well conditioned: all of O's spectrum is in band
        sv = torch.linalg.svdvals(O)
        assert NS_BAND[0] <= sv.min() and sv.max() <= NS_BAND[1]


def reference_muon(W0, grads, lrs, momentum, nesterov, beta2, weight_decay):
    """Muon written out plainly, one matrix at a time, for comparison with the batched implementation.
    Tall matrices use the right-multiplication form X (bA + cA^2), A = X^T X, instead of transposing."""
    a, b, c = NS_COEFFS
    rows, cols = W0.shape
    Wt, buf = W0.clone(), torch.zeros_like(W0)
    v = torch.zeros(1, cols) if rows <= cols else torch.zeros(rows, 1)
    for G, lr in zip(grads, lrs):
        buf = momentum * buf + (1 - momentum) * G
        g = (1 - momentum) * G + momentum * buf if nesterov else buf
        X = g / (g.norm() + 1e-7)
        for _ in range(5):
            if rows <= cols:
                A = X @ X.T
                X = a * X + (b * A + c * A @ A) @ X
            else:
                A = X.T @ X
                X = a * X + X @ (b * A + c * A @ A)
        stat = (X ** 2).mean(dim=0, keepdim=True) if rows <= cols else (X ** 2).mean(dim=1, keepdim=True)
        v = beta2 * v + (1 - beta2) * stat
        Y = X / v.sqrt()
        Y = Y * (X.norm() / Y.norm()) * math.sqrt(max(1.0, rows / cols))
        same_sign = (torch.sign(Y) * torch.sign(Wt)) > 0
        Wt = Wt - lr * weight_decay * Wt * same_sign - lr * Y
    return Wt


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (24, 24)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_reference(shape, nesterov):
    gen = torch.Generator().manual_seed(7)
    W0 = torch.randn(shape, generator=gen) * 0.1
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    lrs = [0.05, 0.03, 0.01]
    kw = dict(momentum=0.9, nesterov=nesterov, beta2=0.95, weight_decay=0.5)
    p = torch.nn.Parameter(W0.clone())
    # two matrices of the same shape exercise the batched path; the second gets the negated grads
    q = torch.nn.Parameter(W0.clone())
    opt = Muon([p, q], lr=lrs[0], **kw)
    for G, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        p.grad, q.grad = G.clone(), -G
        opt.step()
    torch.testing.assert_close(p.detach(), reference_muon(W0, grads, lrs, **kw), atol=1e-6, rtol=0)
    torch.testing.assert_close(q.detach(), reference_muon(W0, [-G for G in grads], lrs, **kw), atol=1e-6, rtol=0)


def test_muon_single_step_by_hand():
    """G = diag(3, 4), momentum 0, W = 0: normalization gives diag(0.6, 0.8); each diagonal entry goes
    through the scalar Newton-Schulz map; the per-column second moment then equalizes the two columns
    and the norm restore makes each entry sqrt((d1^2 + d2^2) / 2). So W_new = -lr * r * I."""
    d1, d2 = ns5_scalar(0.6), ns5_scalar(0.8)
    r = math.sqrt((d1 ** 2 + d2 ** 2) / 2)
    lr = 0.1
    p = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.diag(torch.tensor([3.0, 4.0]))
    Muon([p], lr=lr, momentum=0.0, weight_decay=0.3).step()
    torch.testing.assert_close(p.detach(), torch.diag(torch.tensor([-lr * r, -lr * r])), atol=1e-6, rtol=0)


def test_cautious_weight_decay_only_where_signs_agree():
    gen = torch.Generator().manual_seed(3)
    W0 = torch.randn(32, 16, generator=gen)
    G = torch.randn(32, 16, generator=gen)
    lr, wd = 0.1, 0.5
    results = {}
    for decay in (0.0, wd):
        p = torch.nn.Parameter(W0.clone())
        p.grad = G.clone()
        Muon([p], lr=lr, weight_decay=decay).step()
        results[decay] = p.detach()
    update = (W0 - results[0.0]) / lr  # p -= lr * update
    agree = (update * W0) > 0
    assert 0 < agree.sum() < agree.numel()  # both cases occur
    # where update and weight disagree in sign the weight decay leaves the coordinate alone
    assert torch.equal(results[wd][~agree], results[0.0][~agree])
    # where they agree it removes exactly lr * wd * W
    torch.testing.assert_close(results[wd][agree], (results[0.0] - lr * wd * W0)[agree], atol=1e-6, rtol=0)


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError, match="2D"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


def test_groups_split_by_shape_keep_lr():
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 8), (8, 4), (4, 8)]]
    opt = Muon(ps, lr=0.01)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1]
    assert all(g["lr"] == 0.01 for g in opt.param_groups)


def _run_single(muon_cls, adam_factory, steps, start=None, saved=None):
    """The worker's parameter set on one process with the rank-averaged gradients."""
    muon_params, adam_params = W.make_params()
    if start is not None:
        for p, s in zip(muon_params + adam_params, start):
            p.data.copy_(s)
    muon_opt = muon_cls(muon_params, **W.MUON_KW)
    adam_opt = adam_factory(W.adam_param_groups(adam_params), **W.ADAM_KW)
    W.record_initial_lr([muon_opt, adam_opt])
    if saved is not None:
        muon_opt.load_state_dict(saved["muon"])
        adam_opt.load_state_dict(saved["adam"])

    def averaged(kind, step, idx, shape):
        return (W.make_grad(kind, step, 0, idx, shape) + W.make_grad(kind, step, 1, idx, shape)) / 2

    W.run_steps(muon_opt, adam_opt, muon_params, adam_params, steps, averaged)
    return [p.detach().clone() for p in muon_params + adam_params], muon_opt, adam_opt


@pytest.mark.parametrize("muon_cls", [Muon, DistMuon])
def test_state_dict_round_trip_resumes_identically(muon_cls):
    """Single process (no process group): 3 steps straight == 2 steps, save, fresh optimizers, load, 1 step."""
    straight, _, _ = _run_single(muon_cls, DistAdamW, range(W.NUM_STEPS))
    mid, muon_opt, adam_opt = _run_single(muon_cls, DistAdamW, range(W.RESUME_AT))
    blob = io.BytesIO()
    torch.save({"muon": muon_opt.state_dict(), "adam": adam_opt.state_dict()}, blob)
    blob.seek(0)
    resumed, _, _ = _run_single(muon_cls, DistAdamW, range(W.RESUME_AT, W.NUM_STEPS), start=mid, saved=torch.load(blob))
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_single_process_dist_optimizers_match_plain_ones():
    """Without a process group DistMuon is Muon and DistAdamW is torch.optim.AdamW."""
    plain, _, _ = _run_single(Muon, torch.optim.AdamW, range(W.NUM_STEPS))
    dist_, _, _ = _run_single(DistMuon, DistAdamW, range(W.NUM_STEPS))
    for a, b in zip(plain, dist_):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_distributed_two_gloo_ranks_match_single_process(tmp_path):
    """DistMuon / DistAdamW on 2 gloo ranks, each with its own gradients, end where Muon /
    torch.optim.AdamW fed the averaged gradients end; both ranks agree; resuming from the per-rank
    optimizer shards matches the uninterrupted run; optimizer state is sharded across ranks."""
    world = 2
    run_ranks(lambda rank: [str(Path(__file__).with_name("dist_optim_worker.py")), str(tmp_path / f"rank{rank}.pt")],
              world_size=world)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(world))

    # both ranks hold bit-identical weights
    for key in ("muon", "adam", "resumed_muon", "resumed_adam"):
        for a, b in zip(r0[key], r1[key]):
            assert torch.equal(a, b), key

    reference, _, _ = _run_single(Muon, torch.optim.AdamW, range(W.NUM_STEPS))
    for got, want in zip(r0["muon"] + r0["adam"], reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for got, want in zip(r0["resumed_muon"] + r0["resumed_adam"], r0["muon"] + r0["adam"]):
        assert torch.equal(got, want)

    # Muon state: each matrix owned by exactly one rank
    owned0, owned1 = set(r0["muon_state_indices"]), set(r1["muon_state_indices"])
    assert owned0.isdisjoint(owned1) and owned0 | owned1 == set(range(len(W.MUON_SHAPES)))
    assert owned0 and owned1
    # AdamW state: sharded params keep moments for half their rows, the others for the whole tensor
    # (state_dict indices follow the param group order)
    order = [i for idx, _ in W.ADAM_GROUPS for i in idx]
    for pos, i in enumerate(order):
        shape = W.ADAM_SHAPES[i]
        sharded = math.prod(shape) >= 1024 and shape[0] % world == 0
        expected = (shape[0] // world, *shape[1:]) if sharded else shape
        assert r0["adam_state_shapes"][pos] == expected == r1["adam_state_shapes"][pos]


def test_scale_initial_lr_starts_every_group_at_the_fraction():
    from nanochat.gpt import scale_initial_lr
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optimizers = [torch.optim.SGD([{"params": [params[0]], "lr": 0.2}, {"params": [params[1]], "lr": 0.004}])]
    assert scale_initial_lr(optimizers, 0.05) is optimizers
    groups = optimizers[0].param_groups
    assert [g["lr"] for g in groups] == [0.2 * 0.05, 0.004 * 0.05]
    assert [g["initial_lr"] for g in groups] == [g["lr"] for g in groups]
