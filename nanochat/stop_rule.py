"""
Stopping a training run on held-out accuracy instead of at a step count: the run measures sampled pass@1 on a
few held-out questions every few steps and stops at the first check that falls in a band [lo, hi].

Why: a model stopped early on purpose (partial credit, so RL has room to improve) sits on the steep part of its
learning curve, where other CPU kernels or another GPU move the accuracy at a fixed step count by more than the
band is wide. The accuracy itself is what the later stages depend on, so that is what the run watches.

The rule (PassBand.observe), at each check of sampled pass@1 p:
  p < lo           continue (at the step cap: BandNotReachedError)
  lo <= p <= hi    stop here
  p > hi           JumpedOverBandError: the run passed the band between two checks (or started above it)

The measurement (measure_pass1): num_samples answers per held-out question at T=1, top-k 50 (chat_rl's eval),
graded by the task's `evaluate`; pass@1 is the mean fraction of correct samples (the unbiased estimator). Each
rank samples a share of the questions and the counts are summed over ranks, so every rank sees the same p and
takes the same decision. The held-out questions are the last ones of a *train* split (held_out_indices): the
test split belongs to the evaluations that come after the run, and training leaves these out.
"""

from dataclasses import dataclass, field

from nanochat.errors import SettingError, UserError
from nanochat.rl.evaluation import EVAL_TEMPERATURE, EVAL_TOP_K, aggregate_pass_at_k, sample_outcomes
from nanochat.runtime.distributed import rank_and_world, rank_share


class MissedBandError(UserError):
    """A run with a pass@1 band ended without a check inside the band. `band` is the PassBand, with its
    checks so far."""

    def __init__(self, band, problem):
        super().__init__(problem)
        self.band = band


class JumpedOverBandError(MissedBandError):
    """A check found pass@1 above the band, the one before it below (or there was none)."""


class BandNotReachedError(MissedBandError):
    """The step cap came with pass@1 still below the band."""


def parse_band(spec, setting="stop_at_pass1"):
    """'LO:HI' -> (lo, hi) with 0 <= lo < hi <= 1; anything else is a SettingError for `setting`."""
    try:
        lo, hi = (float(x) for x in spec.split(":"))
    except ValueError:
        raise SettingError(setting, f"must be LO:HI (two numbers such as 0.25:0.5), got {spec!r}") from None
    if not 0 <= lo < hi <= 1:
        raise SettingError(setting, f"must be LO:HI with 0 <= LO < HI <= 1, got {spec!r}")
    return lo, hi


@dataclass
class PassBand:
    """The stop decision on a sequence of (step, pass@1) checks; see the module docstring."""
    lo: float
    hi: float
    checks: list = field(default_factory=list)  # [(step, pass1)] in order

    def observe(self, step, pass1, final=False):
        """Record the check at `step`; True = stop now (pass1 in the band), False = go on (below it).
        final: `step` is the step cap, so a pass1 below the band is BandNotReachedError. Raises
        JumpedOverBandError for a pass1 above the band."""
        previous = self.checks[-1] if self.checks else None
        self.checks.append((step, pass1))
        if pass1 > self.hi:
            before = (f"from {previous[1]:.4f} at step {previous[0]}" if previous else "at the first check")
            raise JumpedOverBandError(self, f"held-out sampled pass@1 jumped over the band {self.describe()}: "
                                            f"{pass1:.4f} at step {step}, {before}")
        if pass1 >= self.lo:
            return True
        if final:
            raise BandNotReachedError(self, f"held-out sampled pass@1 is {pass1:.4f} at step {step}, the step cap, "
                                            f"still below the band {self.describe()}")
        return False

    @property
    def last(self):
        """(step, pass1) of the latest check, or None."""
        return self.checks[-1] if self.checks else None

    def in_band(self):
        return bool(self.checks) and self.lo <= self.checks[-1][1] <= self.hi

    def describe(self):
        return f"[{self.lo:g}, {self.hi:g}]"

    def summary(self):
        """What a checkpoint's meta records: the band, the last check (the step saved) and every check."""
        step, pass1 = self.last if self.checks else (None, None)
        return {"band": [self.lo, self.hi], "step": step, "pass1": pass1, "in_band": self.in_band(),
                "checks": [list(c) for c in self.checks]}


def held_out_indices(task_size, num_questions):
    """The held-out questions of a split of task_size questions: its last num_questions, by index. Training
    on that split takes the first task_size - num_questions only."""
    if not 0 < num_questions < task_size:
        raise ValueError(f"cannot hold out {num_questions} of {task_size} questions and train on the rest")
    return range(task_size - num_questions, task_size)


def measure_pass1(engine, task, indices, num_samples, max_new_tokens, autocast, reduce_device, seed=0):
    """Sampled pass@1 (T=1, top-k 50, the mean fraction of correct samples) on task[i] for i in `indices`,
    the questions of all ranks together: this rank samples its share (rank_share of the positions in
    `indices`), and the counts are summed over the process group. Question i is seeded with seed + i, so
    the answer does not depend on the rank layout. The engine's model samples in eval mode under `autocast`
    and is put back in the mode it was in. Give every check of a run the same engine: its static batch (and on
    CUDA its graphs) is kept from one check to the next."""
    rank, world_size = rank_and_world()
    mine = [indices[p] for p in rank_share(0, len(indices), rank, world_size)]
    model = engine.model
    was_training = model.training
    model.eval()
    try:
        with autocast:
            outcomes = sample_outcomes(engine, task, mine, num_samples, max_new_tokens,
                                       temperature=EVAL_TEMPERATURE, top_k=EVAL_TOP_K, seed=seed) if mine else []
    finally:
        model.train(was_training)
    return aggregate_pass_at_k(outcomes, num_samples, device=reduce_device).unbiased[0]
