"""
Dynamic loss scaling for training in fp16 (--dtype=float16): the weights stay fp32 (the master copy), autocast
computes in fp16, and the gradient is backpropagated from the loss times a scale S, so that small gradients do not
underflow fp16's range. torch.amp.GradScaler's rule, with its defaults:

  1. backward of S * loss                        (S = 2**16 at the start)
  2. every gradient times 1/S                    (exact: S is a power of 2)
  3. a gradient that is not finite on any rank (an overflow of S * gradient in fp16) skips the step on every rank,
     and S halves; otherwise the optimizers step, and after growth_interval (2000) such steps in a row S doubles

Why not GradScaler itself: its step(optimizer) decides on each rank alone whether to step, and the sharded
optimizers here (nanochat/optim/) need every rank to step or none. So the decision is guarded_step's check across
ranks (nanochat/optim/optimizers.py), which refuses a non-finite gradient anyway, and this class keeps only the
scale and its growth counter; update() is GradScaler's update kernel (torch._amp_update_scale_) written out, which
tests/optim/test_fp16.py checks against it. The scale is the same on every rank (each rank updates it from the same
all-reduced answer), is saved in the run's meta and restored by --resume.

Where S enters (step 1): chat_rl backpropagates its objective chunk by chunk inside the training pass
(nanochat/rl/policy_gradient.py), and every term of it is a function of the forward's log-probabilities; so
scaled_forward() multiplies the gradient arriving at those log-probabilities by S, which is the gradient of S * loss
to the bit (S a power of 2; the objective is computed from the log-probabilities in fp32).
"""

import math

import torch

from nanochat.runtime.distributed import print0

# GradScaler's defaults
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000


def scale_text(scale):
    """A scale as the step line shows it: whole numbers in full (65536, 16777216), others as %g."""
    return str(int(scale)) if math.isfinite(scale) and scale >= 1 and scale == int(scale) else f"{scale:g}"


def as_float32(x):
    """x rounded to float32 (GradScaler keeps its scale in a float32 tensor); inf where it overflows."""
    return torch.tensor(x, dtype=torch.float64).float().item()


class LossScale:
    """The dynamic loss scale of an fp16 run: `scale` (S) and `growth_tracker` (good steps in a row since S last
    changed), as GradScaler keeps them; `overflowed`: the last update skipped a step whose loss was finite on every
    rank (the scaled gradient overflowed), which the step line reports."""

    def __init__(self, init_scale=INIT_SCALE, growth_factor=GROWTH_FACTOR, backoff_factor=BACKOFF_FACTOR,
                 growth_interval=GROWTH_INTERVAL):
        self.scale = as_float32(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0
        self.overflowed = False

    def unscale_(self, model):
        """Every gradient of `model` times 1/S, in place (step 2)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, found_inf):
        """Step 3's scale update after a step: found_inf, a gradient was not finite on some rank (the same answer on
        every rank): the step was skipped for it. torch._amp_update_scale_'s arithmetic, in float32."""
        self.overflowed = found_inf
        if found_inf:
            self.scale = as_float32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        successful = self.growth_tracker + 1
        if successful == self.growth_interval:
            grown = as_float32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0
        else:
            self.growth_tracker = successful

    def hold(self):
        """A step skipped for another reason than its gradient (a non-finite loss): the scale and its count of good
        steps stay, and the step is no overflow."""
        self.overflowed = False

    def overflow_note(self, step):
        """The warning of a step skipped for an overflow, or None. Such steps do not count towards --max-bad-steps
        while S >= 1 (a smaller S may fit); below 1 the gradient overflows fp16 unscaled, and they count."""
        if not self.overflowed or self.scale < 1:
            return None
        return (f"warning: step {step}: the fp16 gradient overflowed at loss scale "
                f"{scale_text(self.scale / self.backoff_factor)} on some rank; the step is skipped on every rank and "
                f"the scale backs off to {scale_text(self.scale)}")

    def record(self):
        """The step's entries of its record (nanochat/rl/progress.py): S after the step's update, and whether the
        step was skipped for an overflow."""
        return {"loss_scale": self.scale, "overflow": float(self.overflowed)}

    def state_dict(self):
        """GradScaler's state_dict keys, plain numbers (the run's meta is JSON)."""
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval, self.growth_tracker = int(state["growth_interval"]), int(state["_growth_tracker"])


def scaled_forward(forward, loss_scale):
    """`forward` (the training pass's chunk forward, its first output the log-probabilities) with the gradient that
    reaches those log-probabilities multiplied by the scale S of `loss_scale` at the call (step 1); `forward` itself
    without a loss scale."""
    if loss_scale is None:
        return forward

    def forward_of_scaled_loss(*args, **kwargs):
        logp, *rest = forward(*args, **kwargs)
        if logp.requires_grad:  # not under no_grad (the reference model's forward)
            scale = loss_scale.scale
            logp.register_hook(lambda grad: grad * scale)
        return (logp, *rest)
    return forward_of_scaled_loss


def loss_scale_for(plan, meta=None):
    """The run's LossScale where it trains in float16 (plan.dtype, the run's RunPlan's), else None; `meta`: a resumed
    step's meta, whose "loss_scale" it continues from."""
    if plan.dtype != "float16":
        return None
    loss_scale = LossScale(INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL)  # read now: tests set them
    saved = (meta or {}).get("loss_scale")
    if saved:
        loss_scale.load_state_dict(saved)
    print0(f"training in float16 with dynamic loss scaling: loss scale {scale_text(loss_scale.scale)}"
           + (" (resumed)" if saved else "") + f", halved on an overflow, doubled after {loss_scale.growth_interval} "
           "good steps in a row")
    return loss_scale
