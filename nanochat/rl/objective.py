"""
The policy-gradient objective: per-token terms, their denominators, and the options around them.

nanochat's objective, per question with N samples split into P = N / device_batch_size passes:
    adv_i     = r_i - mean(r)                                  (no std division, no KL, no clipping)
    pg_pass   = sum_{rows, t in pass} logp_t * adv_row  /  (valid_targets_in_pass * P * examples_per_rank)
    loss      = -sum over the rank's questions and passes of pg_pass
Gradients are then averaged over ranks by the optimizers, so the objective is a mean over the step's questions.

Algorithm options (PolicyLoss; each default is nanochat's). For sampled token t of row i, with A_i its advantage
and D_i its row's denominator, the objective (maximised) is sum_t A_i * logp_t / D_i, where D_i is, by loss_norm:
    pass      valid tokens of i's pass * P * examples_per_rank                      (nanochat, above)
    token     valid tokens of the step on all ranks / W                             (DAPO: one token-level mean)
    sequence  valid tokens of i * sequences of the step on all ranks / W            (GRPO: mean of sequence means)
    constant  rows of i's question * max_new_tokens * questions on all ranks / W    (Dr. GRPO)
W is the number of ranks: the optimizers average gradients over ranks, so a rank divides by 1/W of the step's count.
  advantage std   A_i = (r_i - mean(r)) / (std(r) + 1e-4), population std        (GRPO, DeepSeekMath)
  mask truncated  rows cut at max_new_tokens have no target and count in no denominator (DAPO overlong filtering)
  PPO epochs      epoch 1 is the on-policy term above; epochs 2.. use old logp_t from epoch 1's forward and
                  min(rho*A, clip(rho, 1 - clip_low, 1 + clip_high)*A) / D_i with rho = exp(logp - old logp)  (PPO, DAPO)
    loss gspo     epochs 2..: min(s_i*A, clip(s_i, ...)*A) / D_i for each token of row i, s_i = exp(mean_t(logp - old))
                  (GSPO: one ratio a sequence; with loss_norm=sequence its mean over sequences)
    loss cispo    epochs 2..: sg(clip(rho, ...)) * A * logp / D_i (CISPO: the clipped ratio weighs, never zeroes)
  KL penalty      - kl_coef * k3_t / D_i, k3 = exp(ref - logp) - (ref - logp) - 1, ref = the frozen starting model
  rollout correction (for the sampler-trainer gap; s_t = the sampler's log-probability of the token under the model
                  at T=1 over the whole vocabulary, recorded by the engine, and w_t = exp(logp_t - s_t) detached):
                    token-tis      each token's term times min(w_t, cap)                   (truncated importance sampling)
                    sequence-mask  a row's terms dropped when prod_t w_t leaves [1/cap, cap]
                    geo-mask       a row's terms dropped when exp(mean_t log w_t), the geometric mean over its
                                   sampled tokens, leaves [1/cap, cap]     (length-normalised: SkyRL's default)
                    token-mask     a token's term dropped when w_t leaves [1/cap, cap]    (token rejection: verl)
Whatever the options, the first epoch measures the gap on the trained tokens: mean and max |logp_t - s_t| and the
k3 estimate of KL(sampler || trainer), mean of exp(d) - d - 1 with d = logp_t - s_t.

On-policy distillation (--teacher, --distill-coef=C, --reward-coef=R; PolicyLoss.per_token): the advantage is per
token, A_t = R * A_i + C * (log p_teacher(x_t) - log p_student(x_t)), in every term above in place of A_i (D_i is the
row's, the reward's). The student's log-probability is the training forward's, detached (the first epoch's; later
epochs reuse it and the teacher's), not the sampler's as recorded: the term is then the reverse KL of the policy being
trained, exactly 0 for a teacher that is the student itself, and needs no sampler log-probability; the sampler's
would carry the sampler-trainer gap (fp32: a few 1e-6 a token; bf16: ~1e-2) into every advantage as noise.

The training pass (nanochat/rl/policy_gradient.py) sums these over each forward's sampled tokens: on_policy_objective
(the first epoch: nanochat's term) or ppo_objective (a later PPO epoch), the rollout correction's weights
(rollout_correction_weights) multiplying either, minus kl_penalty.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanochat.model.head import logprobs_and_entropy
from nanochat.rl.advantages import QuestionBatch


def token_logprobs_and_entropy(logits, targets):
    """From one forward's logits (..., V), the log-probability of each target (...) (0 where target == -1) and the
    mean entropy over the valid positions (a detached scalar: a diagnostic): nanochat/model/head.py's
    logprobs_and_entropy, which the model's chunked head (GPT.sampled_logprobs) computes without the (N, V) logits."""
    return logprobs_and_entropy(logits, targets)


LOSS_NORMS = ("pass", "token", "sequence", "constant")
ROLLOUT_CORRECTIONS = ("none", "token-tis", "sequence-mask", "geo-mask", "token-mask")
MASK_CORRECTIONS = ("sequence-mask", "geo-mask", "token-mask")  # those that drop tokens instead of weighing them
REJECTED_TOKENS = ("counted", "uncounted")  # chat_rl's --rejected-tokens: PolicyLoss.rejected_in_denominator or not
LOSSES = ("pg", "gspo", "cispo")
# each loss's ratio clip (clip_low, clip_high) where --clip-low/--clip-high are not given: PPO's 0.2 (nanochat has no
# clip: it takes one on-policy epoch); GSPO's sequence ratio is a per-token geometric mean, so its band is narrow (the
# GSPO paper, v2, section 5.1: 3e-4 and 4e-4); CISPO bounds its weight above only (MiniMax-M1: no lower bound,
# clip_low 1 = a floor of 0) at DAPO's 1.28, the common default of CISPO implementations (the paper tunes it)
LOSS_CLIPS = {"pg": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


@dataclass
class PolicyLoss:
    """How the objective is formed (the formulas are in the module docstring). Every default is nanochat's."""
    loss_norm: str = "pass"       # pass | token | sequence | constant: what each token's term is divided by
    max_new_tokens: int = 0       # the rollouts' length cap; the `constant` denominator uses it
    mask_truncated: bool = False  # rows cut at max_new_tokens carry no gradient and count in no denominator
    loss: str = "pg"              # pg | gspo | cispo: the term of a PPO epoch after the first (the first is on-policy)
    clip_low: float = 0.2         # PPO epochs after the first clip the ratio to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    kl_coef: float = 0.0          # weight of the k3 KL penalty to the reference model (0: no penalty)
    rollout_correction: str = "none"  # one of ROLLOUT_CORRECTIONS (see the module docstring)
    correction_cap: float = 2.0       # token-tis: the weight's cap; the masks: the ratio's band [1/cap, cap]
    # a mask's dropped tokens still count in the denominators (True, today's), or leave them (the peers': slime,
    # verl): the step's targets lose them before any denominator is counted (policy_gradient.without_rejected_tokens)
    rejected_in_denominator: bool = True
    # on-policy distillation (the module docstring): each sampled token's advantage is reward_coef * its row's
    # reward advantage + distill_coef * (log p_teacher - log p_student); (1, 0): nanochat's row advantage, as it was
    reward_coef: float = 1.0
    distill_coef: float = 0.0

    @property
    def per_token(self):
        """Whether the advantages are per token (a teacher's term, or the reward's weighed): not nanochat's path."""
        return self.distill_coef != 0 or self.reward_coef != 1

    def __post_init__(self):
        if self.loss_norm not in LOSS_NORMS:
            raise ValueError(f"loss_norm must be one of {', '.join(LOSS_NORMS)}, got {self.loss_norm!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be one of {', '.join(ROLLOUT_CORRECTIONS)}, "
                             f"got {self.rollout_correction!r}")
        if not self.correction_cap > 1:
            raise ValueError(f"correction_cap must be > 1, got {self.correction_cap}")
        if self.loss == "gspo" and self.distill_coef != 0:
            raise ValueError("loss='gspo' weighs a row's tokens by one sequence ratio; per-token advantages (a teacher) "
                             "need pg or cispo")
        if self.loss_norm == "constant" and self.max_new_tokens < 1:
            raise ValueError("loss_norm='constant' divides by max_new_tokens; pass the rollouts' length cap (>= 1)")


@dataclass
class StepCounts:
    """The step's totals over every rank, for the token, sequence and constant denominators (see step_counts)."""
    tokens: int       # sampled tokens of the rows that count
    sequences: int    # rows that count and hold at least one sampled token
    questions: int    # questions with at least one row that counts
    world_size: int   # ranks the optimizers average the gradients over


def counted_rows(batch, mask_truncated):
    """(R,) bool: the rows that take part in the objective: all of them, or with mask_truncated the ones
    that ended by themselves."""
    if not mask_truncated or batch.truncated is None:
        return torch.ones(batch.targets.size(0), dtype=torch.bool)
    return ~batch.truncated


def trainable_targets(batch, mask_truncated):
    """batch.targets (R, T), with every target of a truncated row set to -1 under mask_truncated (overlong
    filtering): such a row carries no gradient and counts in no denominator."""
    if not mask_truncated or batch.truncated is None or not bool(batch.truncated.any()):
        return batch.targets
    return batch.targets.masked_fill(batch.truncated[:, None], -1)


def step_counts(batches, mask_truncated, device):
    """StepCounts of this rank's batches summed over all ranks: one all_reduce under a process group, so every
    rank must call it at the same point (once per step, not inside a retry). device: a tensor device the
    process group can reduce (the rank's CUDA device under NCCL)."""
    local = [0, 0, 0]
    for batch in batches:
        valid = trainable_targets(batch, mask_truncated) >= 0  # (R, T)
        local[0] += int(valid.sum())
        local[1] += int(valid.any(1).sum())
        local[2] += int(counted_rows(batch, mask_truncated).any())
    totals = torch.tensor(local, dtype=torch.long, device=device)
    world_size = 1
    if dist.is_initialized():
        dist.all_reduce(totals)
        world_size = dist.get_world_size()
    tokens, sequences, questions = totals.tolist()
    return StepCounts(tokens=tokens, sequences=sequences, questions=questions, world_size=world_size)


def pass_denominators(targets, device_batch_size, examples_per_rank):
    """nanochat's row denominators (R,) long: valid targets of the row's pass * passes * examples_per_rank."""
    R = targets.size(0)
    num_passes = R // device_batch_size
    valid_per_pass = (targets >= 0).reshape(num_passes, -1).sum(1).clamp(min=1)  # (P,)
    return valid_per_pass.repeat_interleave(device_batch_size) * (num_passes * examples_per_rank)


def row_denominators(targets, loss_norm, device_batch_size, examples_per_rank, counts=None, rows_counted=None,
                     max_new_tokens=0):
    """(R,) the denominator D of each row of one question: each of the row's sampled tokens adds
    A * logp / D to the objective. targets: (R, T) with -1 where there is no target (truncated rows already
    masked); counts: the step's StepCounts (all but `pass`); rows_counted: the question's rows that count
    (`constant`). Step-level counts are divided by the world size because the optimizers average the
    ranks' gradients: sum over ranks of (rank's sum / (count / W)) / W = (sum over all ranks) / count."""
    if loss_norm == "pass":
        return pass_denominators(targets, device_batch_size, examples_per_rank)
    R = targets.size(0)
    per_rank = lambda total: max(total, 1) / counts.world_size
    if loss_norm == "token":       # DAPO: one mean over every sampled token of the step
        return torch.full((R,), per_rank(counts.tokens), dtype=torch.float64)
    if loss_norm == "sequence":    # each sequence's token mean, then the mean over the step's sequences
        return (targets >= 0).sum(1).clamp(min=1).double() * per_rank(counts.sequences)
    if loss_norm == "constant":    # Dr. GRPO: question sum / (samples * max_new_tokens), mean over questions
        return torch.full((R,), max(int(rows_counted), 1) * max_new_tokens * per_rank(counts.questions), dtype=torch.float64)
    raise ValueError(f"loss_norm must be one of {', '.join(LOSS_NORMS)}, got {loss_norm!r}")


@dataclass
class QuestionRows:
    """One question's rows as the objective sees them (see QuestionRows.of)."""
    index: int                  # its place in the step's batches (and in an epoch's kept per-question tensors)
    batch: QuestionBatch
    targets: torch.Tensor       # (R, T) trainable targets (trainable_targets: truncated rows masked under mask_truncated)
    denominators: torch.Tensor  # (R,) D of each row (row_denominators)
    weights: torch.Tensor       # (R,) A / D
    advantages: torch.Tensor    # (R,) A: the batch's

    @classmethod
    def of(cls, index, batch, loss, device_batch_size, examples_per_rank, counts):
        """The rows of `batch`, the index-th question of the step, under `loss` (counts: see row_denominators)."""
        targets = trainable_targets(batch, loss.mask_truncated)  # (R, T)
        denominators = row_denominators(targets, loss.loss_norm, device_batch_size, examples_per_rank, counts,
                                        rows_counted=counted_rows(batch, loss.mask_truncated).sum(),
                                        max_new_tokens=loss.max_new_tokens)  # (R,)
        weights = batch.advantages / denominators.to(batch.advantages.dtype)
        return cls(index, batch, targets, denominators, weights, advantages=batch.advantages)


def clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high):
    """PPO's clipped surrogate per sampled token (to be maximised), all (N,):
    min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A) with rho = exp(logp - old_logp).
    Returns (surrogate, rho, clipped); clipped marks the tokens where the clipped term is the smaller one,
    so their gradient is 0 (A > 0 with rho > 1 + clip_high, A < 0 with rho < 1 - clip_low)."""
    ratio = torch.exp(logp - old_logp)
    surrogate, clipped = clipped_ratio_objective(ratio, advantages, clip_low, clip_high)
    return surrogate, ratio, clipped


def clipped_ratio_objective(ratio, advantages, clip_low, clip_high):
    """min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), all (N,), and where the clipped term is the
    smaller one (no gradient there): the clipped objective of PPO's token ratio and of GSPO's sequence ratio."""
    unclipped = ratio * advantages
    clipped_term = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return torch.minimum(unclipped, clipped_term), clipped_term < unclipped


def k3_kl(logp, ref_logp):
    """Per-token k3 estimate of KL(policy || reference) from tokens the policy sampled (Schulman's k3, the
    penalty of DeepSeekMath's GRPO): exp(ref - logp) - (ref - logp) - 1, >= 0, and 0 with a zero gradient
    where the two log-probabilities are equal. logp, ref_logp: (N,)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def gspo_surrogate(logp, old_logp, advantages, row_index, num_rows, clip_low, clip_high):
    """GSPO's clipped surrogate (Zheng et al. 2025), per sampled token (to be maximised), all (N,): row i's ratio is
    the geometric mean of its tokens' ratios, s_i = exp(mean over its tokens of (logp - old_logp)), and each of its
    tokens gets min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i). Divided by the rows' denominators D_i
    (row_denominators), the row's term counts once per token: under loss_norm=sequence, where D_i holds the row's
    tokens, the objective is GSPO's mean over the step's sequences. row_index: (N,) each token's row among the
    chunk's num_rows (a row's tokens are never split between chunks). Returns (surrogate, s per token, clipped)."""
    zeros = torch.zeros(num_rows, dtype=logp.dtype, device=logp.device)
    log_ratio_sum = zeros.index_add(0, row_index, logp - old_logp)
    tokens = zeros.index_add(0, row_index, torch.ones_like(logp))
    ratio = torch.exp(log_ratio_sum / tokens.clamp(min=1))[row_index]  # (N,)
    surrogate, clipped = clipped_ratio_objective(ratio, advantages, clip_low, clip_high)
    return surrogate, ratio, clipped


def cispo_objective(logp, old_logp, advantages, clip_low, clip_high):
    """CISPO's term (MiniMax-M1, Chen et al. 2025), per sampled token (to be maximised), all (N,):
    sg(clip(rho, 1 - clip_low, 1 + clip_high)) * A * logp with rho = exp(logp - old_logp): the ratio weighs the
    policy gradient and is not differentiated, so a token whose ratio leaves the band keeps its gradient (PPO's
    clip gives it none). Returns (term, rho, truncated): truncated marks the tokens whose weight the clip changed."""
    ratio = torch.exp(logp - old_logp)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high).detach()
    return weight * advantages * logp, ratio, (ratio < 1 - clip_low) | (ratio > 1 + clip_high)


def later_epoch_terms(loss, logp, old_logp, advantages, row_index, num_rows):
    """Each sampled token's term (N,) in a PPO epoch after the first, by loss.loss (pg: clipped_surrogate; gspo:
    gspo_surrogate; cispo: cispo_objective), and the tokens whose value the clip changed (N,) bool. row_index: (N,)
    each token's row among the chunk's num_rows (GSPO's ratio is a row's)."""
    if loss.loss == "gspo":
        term, _, clipped = gspo_surrogate(logp, old_logp, advantages, row_index, num_rows, clip_low=loss.clip_low,
                                          clip_high=loss.clip_high)
    elif loss.loss == "cispo":
        term, _, clipped = cispo_objective(logp, old_logp, advantages, loss.clip_low, loss.clip_high)
    else:
        term, _, clipped = clipped_surrogate(logp, old_logp, advantages, loss.clip_low, loss.clip_high)
    return term, clipped


# A forward's terms, summed over its N sampled tokens (to be maximised), as the training pass composes them. Every
# argument is (N,) unless said otherwise; denominators are the tokens' rows' D (row_denominators).
def on_policy_objective(logp, weights, correction=None):
    """nanochat's term, sum_t logp_t * A_t / D_t: the first epoch's, where the policy is the one that sampled (PPO's
    ratio is 1, so the clipped surrogate's gradient is this one's). weights: A / D of each token's row, divided on
    the host; correction: the rollout correction's weights, or None (nanochat: none)."""
    if correction is not None:
        weights = weights * correction
    return (logp * weights).sum()


def ppo_objective(loss, logp, old_logp, advantages, denominators, row_index, num_rows, correction=None):
    """A PPO epoch after the first: sum_t term_t / D_t, loss.loss's term against the first epoch's log-probabilities
    old_logp (later_epoch_terms), each times its correction weight (the first epoch's; None: none). row_index: each
    token's row among the forward's num_rows. Returns (the sum, the tokens whose value the clip changed (N,) bool)."""
    term, clipped = later_epoch_terms(loss, logp, old_logp, advantages, row_index, num_rows=num_rows)
    if correction is not None:
        term = term * correction
    return (term / denominators).sum(), clipped


def kl_penalty(kl_coef, kl, denominators):
    """What the KL penalty takes off the objective: kl_coef * sum_t k3_t / D_t, kl the k3 of each token (k3_kl)."""
    return kl_coef * (kl / denominators).sum()


class EpochTerms(NamedTuple):
    """One forward's objective in an epoch (0-dim, to be maximised) and what the epoch tallies of it, 0-dim sums on the
    device (None where the epoch has none): the tokens the clip changed and the k3 KL from the old policy (the epochs
    after the first), the k3 KL from the reference (kl_coef > 0)."""
    objective: torch.Tensor
    clipped: Optional[torch.Tensor] = None
    approx_kl: Optional[torch.Tensor] = None
    kl_ref: Optional[torch.Tensor] = None


def epoch_objective(loss, first, logp, row_values, row_index, num_rows, correction=None, old_logp=None, ref_logp=None):
    """One forward's objective, where every option of `loss` applies: nanochat's on-policy term in the first epoch
    (on_policy_objective), loss.loss's clipped term against the first epoch's log-probabilities old_logp in a later
    one (ppo_objective), either times the rollout correction's weights (None: none), minus the KL penalty against the
    reference's ref_logp where loss.kl_coef > 0 (in every epoch alike). row_values(name): (N,) each token's row's
    weights, advantages or denominators (QuestionRows), asked for where a term needs them. Returns EpochTerms."""
    if first:
        terms = EpochTerms(on_policy_objective(logp, row_values("weights"), correction))
    else:
        objective, clipped = ppo_objective(loss, logp, old_logp, row_values("advantages"), row_values("denominators"),
                                           row_index=row_index, num_rows=num_rows, correction=correction)
        with torch.no_grad():
            log_ratio = logp - old_logp
            terms = EpochTerms(objective, clipped.sum(), (torch.expm1(log_ratio) - log_ratio).sum())
    if loss.kl_coef > 0:
        kl = k3_kl(logp, ref_logp)  # (N,)
        penalty = kl_penalty(loss.kl_coef, kl, row_values("denominators"))
        terms = terms._replace(objective=terms.objective - penalty, kl_ref=kl.detach().sum())
    return terms


def sampler_gap(logp, sampler_logp):
    """(gap, known), both (N,): the trainer's log-probability minus the sampler's, 0 where the sampler's is unknown
    (nan), and where it is known."""
    known = ~torch.isnan(sampler_logp)
    return torch.where(known, logp - sampler_logp, torch.zeros_like(logp)), known


def rollout_correction_weights(loss, gap, known, row_index, num_rows, dtype):
    """The weight of each token under loss.rollout_correction, from its sampler_gap (the weights in `dtype` where
    they are 0 or 1), and how many tokens it changed (a 0-dim tensor); weights None without a correction.
    token-tis: min(exp(gap), cap), 1 where unknown; token-mask: 0 where |gap| > log(cap), else 1; sequence-mask:
    1 where the summed gap of the token's row (its index among the forward's num_rows) lies within +-log(cap), else
    0; geo-mask: likewise the row's mean gap over its tokens with a sampler log-probability."""
    band = math.log(loss.correction_cap)
    if loss.rollout_correction == "token-tis":
        weights = torch.where(known, torch.exp(gap).clamp(max=loss.correction_cap), torch.ones_like(gap))
        return weights, (known & (gap > band)).sum()
    if loss.rollout_correction == "token-mask":
        kept = gap.abs() <= band  # an unknown token's gap is 0: kept
        return kept.to(dtype), (~kept).sum()
    if loss.rollout_correction in ("sequence-mask", "geo-mask"):
        row_log_ratio = torch.zeros(num_rows, device=gap.device, dtype=gap.dtype).index_add_(0, row_index, gap)
        if loss.rollout_correction == "geo-mask":  # the mean: a per-token gap does not compound over a long row
            known_tokens = torch.zeros_like(row_log_ratio).index_add_(0, row_index, known.to(gap.dtype))
            row_log_ratio = row_log_ratio / known_tokens.clamp(min=1)
        kept = (row_log_ratio.abs() <= band)[row_index]  # (N,)
        return kept.to(dtype), (~kept).sum()
    return None, torch.zeros((), device=gap.device)


def sampler_gap_sums(gap, known, corrected, sums=None):
    """The first epoch's measure of the gap, as (5,) sums kept on the device: tokens with a sampler log-probability,
    sum and max of |gap|, sum of k3 = exp(gap) - gap - 1, tokens the rollout correction changed. gap, known: one
    forward's sampler_gap; corrected: its changed tokens (0-dim); sums: the earlier forwards' (None: none)."""
    absolute = gap.abs()  # 0 where unknown: neutral for the sum and the max
    values = torch.stack([known.sum().to(gap.dtype), absolute.sum(), F.pad(absolute, (0, 1)).max(),  # N may be 0
                          (torch.expm1(gap) - gap).clamp(min=0).sum(),  # k3 >= 0; expm1 keeps tiny gaps exact
                          corrected.to(gap.dtype)])
    if sums is None:
        return values
    return torch.cat([sums[:2] + values[:2], torch.maximum(sums[2:3], values[2:3]), sums[3:] + values[3:]])


# On-policy distillation's per-token advantages (the module docstring), every argument (N,) over a forward's tokens
def token_advantages(loss, row_advantages, teacher_logp=None, student_logp=None):
    """(N,) each sampled token's advantage: loss.reward_coef * its row's reward advantage (N,), plus, with a teacher,
    loss.distill_coef * (teacher_logp - student_logp) (both (N,), the student's detached)."""
    advantages = row_advantages if loss.reward_coef == 1 else loss.reward_coef * row_advantages
    if teacher_logp is None:
        return advantages
    return advantages + loss.distill_coef * (teacher_logp - student_logp.detach())


def per_token_values(loss, row_values, teacher_logp=None, student_logp=None):
    """epoch_objective's row_values(name) with per-token advantages (token_advantages) in place of the rows': its
    "advantages", and "weights" = advantages / denominators; "denominators" the rows' (a row's normalization is
    the reward's). Each (N,)."""
    def values(name):
        if name == "denominators":
            return row_values(name)
        advantages = token_advantages(loss, row_values("advantages"), teacher_logp, student_logp)
        return advantages if name == "advantages" else advantages / row_values("denominators")
    return values


def distill_sums(logp, teacher_logp):
    """(2,) device sums over a chunk's tokens: log p_student - log p_teacher (the reverse KL's estimate) and
    log p_teacher."""
    logp = logp.detach()
    return torch.stack([(logp - teacher_logp).sum(), teacher_logp.sum()]).float()
