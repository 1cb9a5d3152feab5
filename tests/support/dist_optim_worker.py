"""
One rank of the 2-process gloo checks of the distributed optimizers, launched by tests/optim/test_optim.py.

Run: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/dist_optim_worker.py OUT.pt
Saves {'resume': ..., 'golden': ...}:
'resume': DistMuon and DistAdamW. Each rank feeds its own gradients (seeded by step, rank and parameter)
for NUM_STEPS steps and saves its final parameters, which parameters it holds optimizer state for, and
the parameters reached by a run interrupted after RESUME_AT steps and resumed from the saved per-rank
optimizer state.
'golden': both recipes' distributed optimizers replay the nanochat fixtures (`replay_fixture`), each
rank fed its own gradients whose average is the fixture's (`rank_grad_fn`).
The parameter sets, gradients and hyperparameters live here so the test builds the same references.
"""

import io
import sys
from pathlib import Path

import torch
import torch.distributed as dist

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "optimizer"
# fixture file -> (recipe, orthogonalization dtype nanochat used when it made the file on CPU)
FIXTURES = {
    "optimizer_jan2026.pt": ("2026-01", torch.bfloat16),
    "optimizer_head.pt": ("2026-07", torch.float32),
}

# Muon matrices: three of one shape (uneven over 2 ranks: padding), a lone wide one, a small one.
MUON_SHAPES = [(64, 32), (64, 32), (64, 32), (32, 64), (12, 20)]
# AdamW: (96, 32) and (64, 48) are sharded; (33, 64) has 2112 elements but an odd dim 0 and
# (16, 16), (8,) are under 1024 elements: those three are all-reduced.
ADAM_SHAPES = [(96, 32), (33, 64), (16, 16), (8,), (64, 48)]
ADAM_GROUPS = [  # (indices into ADAM_SHAPES, group options)
    ([0, 1], dict(lr=0.01)),
    ([2, 3, 4], dict(lr=0.003, weight_decay=0.0)),
]
# fp32 orthogonalization: the comparisons below must not depend on this CPU's bf16 kernels
MUON_KW = dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, beta2=0.95, weight_decay=0.1,
               ortho_dtype=torch.float32)
# eps is large on purpose: with a tiny eps Adam is invariant to the gradient's scale, so a missing
# division by the world size (sum instead of mean) would go unnoticed. (Muon is scale invariant anyway.)
ADAM_KW = dict(betas=(0.8, 0.95), eps=0.1, weight_decay=0.05)
LR_MULTIPLIERS = [1.0, 0.7, 0.4]  # the RL loop rescales group['lr'] every step; so do we
NUM_STEPS = len(LR_MULTIPLIERS)
RESUME_AT = 2


def make_params():
    """Fresh (muon_params, adam_params), identical on every rank."""
    g = torch.Generator().manual_seed(1234)
    muon = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in MUON_SHAPES]
    adam = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ADAM_SHAPES]
    return muon, adam


def make_grad(kind, step, rank, idx, shape):
    """Rank-specific gradient; kind is 'muon' or 'adam'."""
    seed = 100_000 * (kind == "adam") + 1000 * step + 100 * rank + idx
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def adam_param_groups(adam_params):
    return [{"params": [adam_params[i] for i in idx], **opts} for idx, opts in ADAM_GROUPS]


def set_lrs(optimizers, step):
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * LR_MULTIPLIERS[step]


def record_initial_lr(optimizers):
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]


def run_steps(muon_opt, adam_opt, muon_params, adam_params, steps, grad_fn):
    """grad_fn(kind, step, idx, shape) -> the gradient to feed."""
    for step in steps:
        for i, p in enumerate(muon_params):
            p.grad = grad_fn("muon", step, i, p.shape)
        for i, p in enumerate(adam_params):
            p.grad = grad_fn("adam", step, i, p.shape)
        set_lrs([muon_opt, adam_opt], step)
        muon_opt.step()
        adam_opt.step()


def load_fixture(name):
    """A golden optimizer file, with its gradients regenerated from their recorded recipe (trim.py there)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("optimizer_fixture_trim", FIXTURE_DIR / "trim.py")
    trim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trim)
    fixture = torch.load(FIXTURE_DIR / name, weights_only=True)
    fixture["grads"] = trim.regenerate_grads(fixture)
    return fixture


def group_kind(opt, group):
    """'adamw' or 'muon' for a param group recorded in a fixture (2026-01 groups have no 'kind')."""
    return group.get("kind") or ("muon" if opt["class"].endswith("Muon") else "adamw")


def fixture_param_groups(fixture, params):
    """The fixture's recorded optimizer groups as build_optimizers specs over `params` (name -> tensor)."""
    specs = []
    for opt in fixture["optimizers"]:
        for group in opt["param_groups"]:
            kind = group_kind(opt, group)
            keys = ("lr", "betas", "eps", "weight_decay") if kind == "adamw" else \
                   ("lr", "momentum", "ns_steps", "beta2", "weight_decay") + (("nesterov",) if "nesterov" in group else ())
            specs.append(dict(kind=kind, params=[params[n] for n in group["params"]], **{k: group[k] for k in keys}))
    return specs


def replay_fixture(fixture, recipe, ortho_dtype, grad_fn=None):
    """Build `recipe`'s optimizers (nanochat.optim.optimizers.build_optimizers) over the fixture's groups and initial
    parameters and take its 3 steps. grad_fn(step, name) -> the gradient to feed (default: the
    fixture's). Returns (final parameters by name, optimizers)."""
    from nanochat.optim.optimizers import build_optimizers

    params = {name: torch.nn.Parameter(value.clone()) for name, value in fixture["initial_params"].items()}
    optimizers = build_optimizers(recipe, fixture_param_groups(fixture, params), ortho_dtype=ortho_dtype)
    for step in range(len(fixture["grads"])):
        for name, p in params.items():
            p.grad = fixture["grads"][step][name].clone() if grad_fn is None else grad_fn(step, name)
        for opt in optimizers:
            opt.step()
    return {name: p.detach() for name, p in params.items()}, optimizers


def rank_grad_fn(fixture, rank):
    """Rank-specific gradients whose average over 2 ranks is exactly the fixture's: each element of 2 * g
    goes to one rank (chosen at random), the other rank gets 0 there. Exactly, because nanochat's bf16
    step amplifies a one-ulp change of its input into ~1% of a matrix's update (see test_optim.py)."""
    def grad_fn(step, name):
        g = fixture["grads"][step][name]
        seed = 1000 * step + fixture["param_names"].index(name)
        to_rank0 = torch.rand(g.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
        mine = to_rank0 if rank == 0 else ~to_rank0
        return torch.where(mine, 2 * g, torch.zeros_like(g))
    return grad_fn


def golden_check(rank):
    out = {}
    for name, (recipe, ortho_dtype) in FIXTURES.items():
        fixture = load_fixture(name)
        params, optimizers = replay_fixture(fixture, recipe, ortho_dtype, rank_grad_fn(fixture, rank))
        out[name] = dict(params=params, classes=[type(opt).__name__ for opt in optimizers])
    return out


def resume_check(rank):
    from nanochat.optim.adamw import DistAdamW
    from nanochat.optim.muon import DistMuon

    def grad_fn(kind, step, idx, shape):
        return make_grad(kind, step, rank, idx, shape)

    def build(muon_params, adam_params):
        opts = DistMuon(muon_params, **MUON_KW), DistAdamW(adam_param_groups(adam_params), **ADAM_KW)
        record_initial_lr(opts)
        return opts

    # the uninterrupted run
    muon_params, adam_params = make_params()
    muon_opt, adam_opt = build(muon_params, adam_params)
    run_steps(muon_opt, adam_opt, muon_params, adam_params, range(NUM_STEPS), grad_fn)
    muon_sd, adam_sd = muon_opt.state_dict(), adam_opt.state_dict()

    # interrupted after RESUME_AT steps: save this rank's optimizer shards, rebuild, load, continue
    r_muon, r_adam = make_params()
    opt1 = build(r_muon, r_adam)
    run_steps(*opt1, r_muon, r_adam, range(RESUME_AT), grad_fn)
    blob = io.BytesIO()
    torch.save({"muon": opt1[0].state_dict(), "adam": opt1[1].state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    r_muon = [torch.nn.Parameter(p.detach().clone()) for p in r_muon]
    r_adam = [torch.nn.Parameter(p.detach().clone()) for p in r_adam]
    opt2 = build(r_muon, r_adam)
    opt2[0].load_state_dict(saved["muon"])
    opt2[1].load_state_dict(saved["adam"])
    run_steps(*opt2, r_muon, r_adam, range(RESUME_AT, NUM_STEPS), grad_fn)

    return {
        "muon": [p.detach() for p in muon_params],
        "adam": [p.detach() for p in adam_params],
        "muon_state_indices": sorted(muon_sd["state"].keys()),
        "adam_state_shapes": {i: tuple(s["exp_avg"].shape) for i, s in adam_sd["state"].items()},
        "resumed_muon": [p.detach() for p in r_muon],
        "resumed_adam": [p.detach() for p in r_adam],
    }


def main(out_path):
    # one launch for both checks: starting two processes costs more than the checks themselves
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.save({"resume": resume_check(rank), "golden": golden_check(rank)}, out_path)
    dist.barrier()
    from nanochat.runtime.distributed import release_process_group
    release_process_group()  # the optimizers' gloo work objects freed now, not in the interpreter's exit


if __name__ == "__main__":
    main(sys.argv[1])
