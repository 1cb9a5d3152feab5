"""
The optimizers of a nanochat recipe, built from one list of param-group specs.

  recipe     nanochat          optimizers (one process)            with a process group
  "2026-01"  7312ec9, Jan 2026 [torch AdamW(fused), Muon]          [DistAdamW, DistMuon]
  "2026-07"  92d63d4, Jul 2026 [MuonAdamW]                         [MuonAdamW] (it shards itself)

The specs are the same for both recipes: which parameters go to AdamW and which to Muon, with the
hyperparameters of each group (see `build_optimizers`). Which lr and betas each kind of parameter gets
in each recipe is the model's business (GPT.setup_optimizers); the fixtures in tests/fixtures/optimizer
record nanochat's choices, and tests/test_optim.py replays them against nanochat's own steps.
"""

import torch
import torch.distributed as dist

from nanochat.adamw import DistAdamW
from nanochat.muon import DistMuon, Muon
from nanochat.muon_adamw import MuonAdamW, split_param_groups

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
