"""
The optimizers of a nanochat recipe.

    param_groups.py  which parameters each optimizer updates, with which lr, betas and weight decay
    optimizers.py    the optimizers built from those groups, the lr schedule, and the step that skips non-finite ones
    muon.py          Muon (the 2026-01 recipe) and its distributed form
    adamw.py         AdamW, sharded ZeRO-2 style across ranks
    muon_adamw.py    MuonAdamW: both in one optimizer (the 2026-07 recipe)
    training_memory.py  what training allocates beyond the model (gradients, optimizer state, a pass's activations),
                     which a run reserves beside the rollouts' KV caches

What used to be `nanochat.optim` (one module) is re-exported here, with nanochat's names since 2026-01-29
(`from nanochat.optim import MuonAdamW, DistMuonAdamW`; DistMuonAdamW is MuonAdamW itself).
"""

from nanochat.optim.muon_adamw import DistMuonAdamW, MuonAdamW
from nanochat.optim.optimizers import (LR_SCHEDULES, RECIPES, all_ranks_finite, build_optimizers, guarded_step,
                                       lr_multiplier, scale_initial_lr)

__all__ = ["DistMuonAdamW", "LR_SCHEDULES", "MuonAdamW", "RECIPES", "all_ranks_finite", "build_optimizers",
           "guarded_step", "lr_multiplier", "scale_initial_lr"]
