"""
What a run's training half holds besides the model and its optimizers (TrainingState): the objective, --kl-coef's
frozen reference, the chunk forward and the rows per forward, fp16's loss scale. The training half reads it
(nanochat/rl/run.py's train_on_rollouts and count_bad_step); of the rest of the run, only the loss scale is read, by
the step's record and the meta.
"""

from dataclasses import dataclass

import torch

from nanochat.optim.loss_scale import scaled_forward
from nanochat.rl.objective import PolicyLoss
from nanochat.rl.policy_gradient import compiled_chunk_forward


@dataclass(frozen=True)
class TrainingState:
    """How a run's training forwards run. Frozen: what changes during the run comes as a new value, in one place
    each: `forward` by --compile=auto's switches (nanochat/rl/auto_switch.py's switched, taken by RLRun.take), `rows`
    by an out-of-memory's retries (train_on_rollouts). The loss scale's own state changes through its methods."""
    policy_loss: PolicyLoss                # the objective the run's algorithm flags choose (policy_loss_of)
    forward: object                        # the chunk forward: compiled or not (--compile), loss-scaled under fp16
    rows: int                              # trained rows per forward; fewer after an out-of-memory
    reference: torch.nn.Module = None      # --kl-coef's frozen starting model, or None
    loss_scale: object = None              # --dtype=float16: the dynamic loss scale (nanochat/optim/loss_scale.py)


def training_forward(compiled, loss_scale, required=False):
    """The training pass's chunk forward: compiled or not (compiled_chunk_forward; required: a compile failure is an
    error), its gradient scaled by `loss_scale` where there is one (fp16)."""
    return scaled_forward(compiled_chunk_forward(compiled, required=required), loss_scale)
