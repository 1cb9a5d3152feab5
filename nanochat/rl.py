"""
The pieces of the RL algorithm that are pure functions of tensors: turning one question's sampled
completions into a training batch, the advantages, and the policy-gradient objective.

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
  KL penalty      - kl_coef * k3_t / D_i, k3 = exp(ref - logp) - (ref - logp) - 1, ref = the frozen starting model
  rollout correction (for the sampler-trainer gap; s_t = the sampler's log-probability of the token under the model
                  at T=1 over the whole vocabulary, recorded by the engine, and w_t = exp(logp_t - s_t) detached):
                    token-tis      each token's term times min(w_t, cap)                   (truncated importance sampling)
                    sequence-mask  a row's terms dropped when prod_t w_t leaves [1/cap, cap]
Whatever the options, the first epoch measures the gap on the trained tokens: mean and max |logp_t - s_t| and the
k3 estimate of KL(sampler || trainer), mean of exp(d) - d - 1 with d = logp_t - s_t.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanochat.common import to_device
from nanochat.sft import collate_rows


@dataclass
class QuestionBatch:
    """One question's samples, ready to train on. R = num_samples rows, T = longest sequence - 1."""
    inputs: torch.Tensor       # (R, T) long: prompt + completion, shifted left
    targets: torch.Tensor      # (R, T) long: next tokens; -1 where the token was not sampled by the policy
    rewards: torch.Tensor      # (R,) float
    advantages: torch.Tensor   # (R,) float: rewards - rewards.mean()
    completion_lengths: list   # (R,) number of generated tokens per row (terminal token excluded)
    prompt_length: int         # tokens of the prompt every row starts with
    truncated: torch.Tensor = None  # (R,) bool: the row was cut at max_new_tokens (None: no row was)
    sampler_logprobs: torch.Tensor = None  # (R, T) float: the sampler's log-probability of each target (under
                                           # the model at T=1, whole vocabulary); nan where target is -1; None: unknown


ADVANTAGE_STD_EPS = 1e-4


def advantages_from_rewards(rewards, scale_by_std=False):
    """rewards: (R,) -> (R,) reward minus the question's mean reward; with scale_by_std (GRPO) divided by the
    rewards' population std + ADVANTAGE_STD_EPS (a question whose rewards are all equal keeps advantages 0)."""
    advantages = rewards - rewards.mean()
    if scale_by_std:
        advantages = advantages / (rewards.std(unbiased=False) + ADVANTAGE_STD_EPS)
    return advantages


def make_question_batch(prompt, completions, rewards, pad_token, truncated=None, scale_by_std=False,
                        sampler_logprobs=None):
    """Build the training tensors for one question.

    prompt: list of token ids; completions: list of (tokens, masks) per sample (mask 1 = sampled,
    0 = forced tool output); rewards: list of floats. Sequences are padded to the longest with
    `pad_token` (mask 0), so padding, the prompt and forced tokens never carry gradient.
    truncated: per sample, True if it was cut at the length cap (Completion.ended False); default none.
    scale_by_std: divide the advantages by the rewards' std (see advantages_from_rewards).
    sampler_logprobs: per sample, the sampler's log-probability of each of its tokens (Completion.logprobs),
    placed where that token is a target.
    """
    rows = [(list(prompt) + list(toks), [0] * len(prompt) + list(masks)) for toks, masks in completions]
    inputs, targets = collate_rows(rows, pad_token)  # the model is only credited for tokens it chose
    rewards = torch.tensor(rewards, dtype=torch.float32)
    truncated = torch.zeros(len(rows), dtype=torch.bool) if truncated is None else torch.tensor(truncated, dtype=torch.bool)
    sampler = None
    if sampler_logprobs is not None:  # the token at sequence position P + j is the target at position P + j - 1
        sampler = torch.full(targets.shape, float("nan"))
        for r, logprobs in enumerate(sampler_logprobs):
            sampler[r, len(prompt) - 1:len(prompt) - 1 + len(logprobs)] = torch.tensor(logprobs, dtype=torch.float32)
        sampler[targets < 0] = float("nan")
    return QuestionBatch(inputs=inputs, targets=targets, rewards=rewards,
                         advantages=advantages_from_rewards(rewards, scale_by_std),
                         completion_lengths=[len(toks) for toks, _ in completions], prompt_length=len(prompt),
                         truncated=truncated, sampler_logprobs=sampler)


def pass_objective(logp, targets, advantages, num_passes, examples_per_rank, num_valid=None):
    """nanochat's per-pass policy-gradient objective (to be maximised).

    logp: (B, T) log-probabilities of the targets (any value where targets == -1; it is masked here).
    targets: (B, T) with -1 on positions that carry no gradient. advantages: (B,).
    Returns sum(logp * adv over valid positions) / (num_valid * num_passes * examples_per_rank), where
    num_valid defaults to the valid positions in these rows; pass the whole pass's count when the rows are
    a chunk of a pass (so chunking a pass to save memory leaves the objective unchanged).
    A pass with no valid target (every row empty) contributes 0.
    """
    valid = targets >= 0
    if num_valid is None:
        num_valid = valid.sum()
    num_valid = max(int(num_valid), 1)
    weighted = torch.where(valid, logp * advantages[:, None].to(logp.dtype), torch.zeros_like(logp))
    return weighted.sum() / (num_valid * num_passes * examples_per_rank)


def token_logprobs_and_entropy(logits, targets):
    """From one forward's logits, the log-probability of each target and the policy's entropy.

    logits: (..., V) float; targets: (...) with -1 for positions without a target.
    Returns logp (...) (0 where target == -1) and the mean entropy over valid positions (a detached
    scalar; the entropy is a diagnostic only, so it needs no second forward and no gradient).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    valid = targets >= 0
    logp = logprobs.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) * valid
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)  # (B, T)
        mean_entropy = (entropy * valid).sum() / valid.sum().clamp(min=1)
    return logp, mean_entropy


LOSS_NORMS = ("pass", "token", "sequence", "constant")
ROLLOUT_CORRECTIONS = ("none", "token-tis", "sequence-mask")


@dataclass
class PolicyLoss:
    """How the objective is formed (the formulas are in the module docstring). Every default is nanochat's."""
    loss_norm: str = "pass"       # pass | token | sequence | constant: what each token's term is divided by
    max_new_tokens: int = 0       # the rollouts' length cap; the `constant` denominator uses it
    mask_truncated: bool = False  # rows cut at max_new_tokens carry no gradient and count in no denominator
    clip_low: float = 0.2         # PPO epochs after the first clip the ratio to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    kl_coef: float = 0.0          # weight of the k3 KL penalty to the reference model (0: no penalty)
    rollout_correction: str = "none"  # none | token-tis | sequence-mask (see the module docstring)
    correction_cap: float = 2.0       # token-tis: the weight's cap; sequence-mask: the ratio's band [1/cap, cap]

    def __post_init__(self):
        if self.loss_norm not in LOSS_NORMS:
            raise ValueError(f"loss_norm must be one of {', '.join(LOSS_NORMS)}, got {self.loss_norm!r}")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be one of {', '.join(ROLLOUT_CORRECTIONS)}, "
                             f"got {self.rollout_correction!r}")
        if not self.correction_cap > 1:
            raise ValueError(f"correction_cap must be > 1, got {self.correction_cap}")
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


def clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high):
    """PPO's clipped surrogate per sampled token (to be maximised), all (N,):
    min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A) with rho = exp(logp - old_logp).
    Returns (surrogate, rho, clipped); clipped marks the tokens where the clipped term is the smaller one,
    so their gradient is 0 (A > 0 with rho > 1 + clip_high, A < 0 with rho < 1 - clip_low)."""
    ratio = torch.exp(logp - old_logp)
    pg_obj1 = ratio * advantages
    pg_obj2 = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return torch.minimum(pg_obj1, pg_obj2), ratio, pg_obj2 < pg_obj1


def k3_kl(logp, ref_logp):
    """Per-token k3 estimate of KL(policy || reference) from tokens the policy sampled (Schulman's k3, the
    penalty of DeepSeekMath's GRPO): exp(ref - logp) - (ref - logp) - 1, >= 0, and 0 with a zero gradient
    where the two log-probabilities are equal. logp, ref_logp: (N,)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


@dataclass
class TrainStats:
    """What accumulate_policy_gradient did on this rank (one epoch)."""
    objective: float        # the objective summed over the rank's tokens (nanochat's sum of pass objectives by default)
    entropy: float          # mean policy entropy over the trained rows' sampled tokens (nan if none)
    rows_trained: int       # rows that went through forward and backward
    rows_total: int
    tokens: int = 0                 # sampled tokens of the trained rows
    clip_fraction: float = None     # PPO epochs after the first: tokens whose clipped term won (no gradient)
    approx_kl: float = None         # ... and mean of (rho - 1) - log rho: the k3 estimate of KL(old || current)
    kl_ref: float = None            # with kl_coef > 0: mean k3 KL(policy || reference) over the tokens
    old_logprobs: list = None       # first epoch: per question (R, T) logp of the sampled tokens (detached)
    ref_logprobs: list = None       # first epoch, kl_coef > 0: the reference's, likewise
    correction_weights: list = None  # first epoch, with a rollout correction: per question (R, T) its weights
    sampler_tokens: int = 0          # first epoch: trained tokens with a sampler log-probability, over which:
    sampler_gap_mean: float = 0.0    #   mean |logp - sampler logp|
    sampler_gap_max: float = 0.0     #   max |logp - sampler logp|
    sampler_k3: float = 0.0          #   mean k3 estimate of KL(sampler || trainer)
    corrected_fraction: float = 0.0  #   tokens the rollout correction changed (token-tis: capped; sequence-mask: dropped)


def _trained_rows(targets, weights, any_weight=False):
    """Rows that can change the gradient: a non-zero weight (advantage), or any weight with any_weight (the KL
    penalty), and at least one sampled token."""
    return [r for r in range(targets.size(0)) if (any_weight or weights[r] != 0) and bool((targets[r] >= 0).any())]


def _prompt_offset(prompt_length, length, share_prompt):
    """The first position _row_hidden_states keeps for rows of `length` inputs: with a shared prompt of
    prompt_length tokens, its last position (the one predicting the first completion token), else 0."""
    return prompt_length - 1 if share_prompt and 1 <= prompt_length <= length else 0


def _row_hidden_states(model, inputs, prompt_length, share_prompt):
    """Hidden states (B, T', C) of the positions that can carry a target, and the offset T - T' they start at.
    With share_prompt the prompt (the first prompt_length tokens, the same in every row) goes through the
    model once and each row's tokens after it attend to it; its last position (the one predicting the first
    completion token) is the only prompt position kept."""
    P, T = prompt_length, inputs.size(1)
    if _prompt_offset(P, T, share_prompt) == 0:
        return model.hidden_states(inputs), 0
    B = inputs.size(0)
    if P == T:
        prompt_hidden = model.hidden_states(inputs[:1])
        return prompt_hidden[:, -1:].expand(B, -1, -1), P - 1
    prompt_hidden, rows_hidden = model.hidden_states_shared_prefix(inputs[:1, :P], inputs[:, P:])
    return torch.cat([prompt_hidden[:, -1:].expand(B, -1, -1), rows_hidden], dim=1), P - 1


def chunk_logprobs(model, inputs, prompt_length, share_prompt, row_index, position, targets):
    """The training pass's forward of one chunk: the log-probabilities logp (N,) of its sampled targets and the
    mean entropy there (see token_logprobs_and_entropy). inputs: (B, T) rows of one question; row_index,
    position (N,): each target's row and position among the positions _row_hidden_states keeps (after the prompt
    offset), row-major; targets (N,) the sampled tokens. Logits only where there is a target (sampled tokens):
    no vocabulary-wide work for prompt, forced tool-output and padding positions. A pure function of tensors
    with no host read: nanochat/compile.py compiles it (dynamic shapes) for the policy, PPO and reference
    forwards alike."""
    hidden, _ = _row_hidden_states(model, inputs, prompt_length, share_prompt)
    logits = model.logits(hidden[row_index, position])  # (N, V)
    return token_logprobs_and_entropy(logits, targets)


def accumulate_policy_gradient(model, batches, device_batch_size, examples_per_rank, device, autocast,
                               micro_batch_rows=None, share_prompt=True, skip_zero_advantage=True,
                               loss=None, counts=None, reference=None, first_epoch=None, forward=chunk_logprobs):
    """Forward/backward the step's rows, accumulating the policy gradient into the model.

    batches: this rank's QuestionBatch list. By default the objective is nanochat's: each question's rows
    form passes of device_batch_size rows, each pass normalized by its own valid-target count (see
    pass_denominators). loss (PolicyLoss, default nanochat's) picks another normalization, masks truncated rows,
    and sets the PPO clip range and the KL coefficient; counts: the step's StepCounts, which the token,
    sequence and constant normalizations need (computed here when None; under a process group that is a
    collective, so compute it once per step with step_counts and pass it). reference: the frozen model of
    the KL penalty (needed when loss.kl_coef > 0).
    first_epoch: None in a step's first epoch: the policy is the one that sampled (ratio 1), the term is
    A * logp / D, and the returned stats keep the sampled tokens' log-probabilities (and the reference's).
    In a later PPO epoch, the first epoch's TrainStats: its log-probabilities are the old policy's and the
    term is the clipped surrogate (clipped_surrogate) / D.
    Only work that can change the gradient is done:
      - rows whose advantage is 0 (every row of a question whose samples were all rewarded alike) are not
        run at all (skip_zero_advantage; with kl_coef > 0 they are, as the penalty gives them a gradient);
        their valid tokens still count in the denominators. Rows without a sampled token are never run;
      - each question's prompt is computed once per forward instead of once per row (share_prompt).
    A forward takes up to micro_batch_rows trained rows of one question (default device_batch_size); a
    smaller value (after an out-of-memory) gives the same gradient. The model provides hidden_states,
    hidden_states_shared_prefix and logits, as GPT does. Every parameter ends with a gradient (zeros if no
    row was trained here), so that distributed optimizers see the same tensors on every rank.
    forward: the chunk forward of the policy and the reference (chunk_logprobs, or its compiled version).
    Returns TrainStats."""
    loss = loss or PolicyLoss()
    first = first_epoch is None
    use_kl = loss.kl_coef > 0
    if use_kl and first and reference is None:
        raise ValueError("kl_coef > 0 needs the reference model (reference=...)")
    if loss.loss_norm != "pass" and counts is None:
        counts = step_counts(batches, loss.mask_truncated, device)
    micro = micro_batch_rows or device_batch_size
    correct = loss.rollout_correction != "none"
    tally = _Tally(old_logprobs=[] if first else first_epoch.old_logprobs,
                   ref_logprobs=([] if use_kl else None) if first else first_epoch.ref_logprobs,
                   correction_weights=([] if correct else None) if first else first_epoch.correction_weights)
    for q, batch in enumerate(batches):
        question_targets = trainable_targets(batch, loss.mask_truncated)  # (R, T)
        denominators = row_denominators(question_targets, loss.loss_norm, device_batch_size, examples_per_rank, counts,
                                        counted_rows(batch, loss.mask_truncated).sum(), loss.max_new_tokens)  # (R,)
        weights = batch.advantages / denominators.to(batch.advantages.dtype)  # (R,)
        R = question_targets.size(0)
        rows = _trained_rows(question_targets, weights, any_weight=use_kl) if skip_zero_advantage else list(range(R))
        tally.rows_total += R
        tally.rows_trained += len(rows)
        if first:  # the sampled tokens' log-probabilities, at their (row, position) in the question's (R, T)
            tally.old_logprobs.append(torch.zeros(question_targets.shape, device=device))
            if use_kl:
                tally.ref_logprobs.append(torch.zeros(question_targets.shape, device=device))
            if correct:
                tally.correction_weights.append(torch.ones(question_targets.shape, device=device))
        question = _Question(q, batch, question_targets, denominators, weights)
        for lo in range(0, len(rows), micro):
            _backward_chunk(model, question, torch.tensor(rows[lo:lo + micro]), loss, first, reference, device, autocast,
                            share_prompt, tally, forward)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return tally.stats(first, use_kl)


@dataclass
class _Question:
    """One question's rows as the objective sees them (see accumulate_policy_gradient)."""
    index: int                  # its place in the step's batches (and in the epoch's stored log-probabilities)
    batch: QuestionBatch
    targets: torch.Tensor       # (R, T) trainable targets (truncated rows masked under mask_truncated)
    denominators: torch.Tensor  # (R,) D of each row
    weights: torch.Tensor       # (R,) A / D


@dataclass
class _Tally:
    """Running sums of one epoch of accumulate_policy_gradient, turned into TrainStats at the end."""
    old_logprobs: list
    ref_logprobs: list
    correction_weights: list = None
    chunk_sums: list = field(default_factory=list)    # per chunk, on the device: (objective, mean entropy)
    chunk_tokens: list = field(default_factory=list)  # per chunk: its sampled tokens
    objective: float = 0.0
    entropy_sum: float = 0.0
    tokens: int = 0
    rows_trained: int = 0
    rows_total: int = 0
    clipped: int = 0
    approx_kl_sum: float = 0.0
    kl_ref_sum: float = 0.0
    sampler: list = None  # device sums over the chunks: tokens, |d| sum, |d| max, k3 sum, corrected tokens

    def add_gap(self, gap, known, corrected):
        """gap: (N,) trainer minus sampler log-probabilities of a chunk's tokens (0 where `known` is False: the
        sampler's is missing); corrected: how many the rollout correction changed. Kept on the device."""
        absolute = gap.abs()  # 0 where unknown: neutral for the sum and the max
        values = torch.stack([known.sum().to(gap.dtype), absolute.sum(), absolute.max(),
                              (torch.expm1(gap) - gap).clamp(min=0).sum(),  # k3 >= 0; expm1 keeps tiny gaps exact
                              corrected.to(gap.dtype)])
        if self.sampler is None:
            self.sampler = values
        else:
            self.sampler = torch.cat([self.sampler[:2] + values[:2], torch.maximum(self.sampler[2:3], values[2:3]),
                                      self.sampler[3:] + values[3:]])

    def stats(self, first, use_kl):
        """TrainStats of the epoch: the device sums are read here, once."""
        host = lambda x: float(x) if isinstance(x, torch.Tensor) else x
        self.clipped, self.approx_kl_sum, self.kl_ref_sum = map(host, (self.clipped, self.approx_kl_sum, self.kl_ref_sum))
        # summed on the host in float64, chunk by chunk, as the objective used to be: the same number to the bit
        for (objective, entropy), tokens in zip(torch.stack(self.chunk_sums).tolist() if self.chunk_sums else [],
                                                self.chunk_tokens):
            self.objective += objective
            self.entropy_sum += entropy * tokens
        per_token = lambda total: total / self.tokens if self.tokens else 0.0
        tokens, gap_sum, gap_max, k3_sum, corrected = self.sampler.tolist() if self.sampler is not None else [0.0] * 5
        per_sampled = lambda total: total / tokens if tokens else 0.0
        return TrainStats(objective=self.objective, entropy=self.entropy_sum / self.tokens if self.tokens else float("nan"),
                          rows_trained=self.rows_trained, rows_total=self.rows_total, tokens=self.tokens,
                          clip_fraction=None if first else per_token(self.clipped),
                          approx_kl=None if first else per_token(self.approx_kl_sum),
                          kl_ref=per_token(self.kl_ref_sum) if use_kl else None,
                          old_logprobs=self.old_logprobs, ref_logprobs=self.ref_logprobs,
                          correction_weights=self.correction_weights, sampler_tokens=int(tokens),
                          sampler_gap_mean=per_sampled(gap_sum), sampler_gap_max=gap_max, sampler_k3=per_sampled(k3_sum),
                          corrected_fraction=per_sampled(corrected))


def _sampler_gap(logp, sampler, row_index, num_rows, loss, tally):
    """Tally the gap between the trainer's log-probabilities logp (N,) (detached) and the sampler's (N,) of the
    same tokens (nan where unknown), and return the rollout correction's weights (N,), or None without one.
    row_index (N,): each token's row among the chunk's num_rows."""
    known = ~torch.isnan(sampler)
    gap = torch.where(known, logp - sampler, torch.zeros_like(logp))
    if loss.rollout_correction == "token-tis":
        weights = torch.where(known, torch.exp(gap).clamp(max=loss.correction_cap), torch.ones_like(gap))
        changed = (known & (gap > math.log(loss.correction_cap))).sum()
    elif loss.rollout_correction == "sequence-mask":
        row_log_ratio = torch.zeros(num_rows, device=logp.device, dtype=gap.dtype).index_add_(0, row_index, gap)
        kept = (row_log_ratio.abs() <= math.log(loss.correction_cap))[row_index]  # (N,)
        weights = kept.to(logp.dtype)
        changed = (~kept).sum()
    else:
        weights, changed = None, torch.zeros((), device=logp.device)
    tally.add_gap(gap, known, changed)
    return weights


def _backward_chunk(model, question, chunk, loss, first, reference, device, autocast, share_prompt, tally, forward):
    """Forward and backward the rows `chunk` (N,) of one question, adding their terms to the model's gradient
    and to the tally. Which positions carry a target is worked out on the host (the batch lives there), so the
    chunk reads nothing back from the device: its sums stay on the device until the epoch ends."""
    q, batch = question.index, question.batch
    targets = question.targets[chunk]  # (B, T) on the host
    offset = _prompt_offset(batch.prompt_length, targets.size(1), share_prompt)  # positions before it are prompt
    valid = targets[:, offset:] >= 0  # (B, T')
    row_host, position_host = valid.nonzero(as_tuple=True)  # (N,): each target's row and position, row-major
    num_tokens = row_host.numel()
    # every host tensor goes over with to_device: queued, so the host can run ahead of the GPU into the next chunk
    row_index, position = to_device(row_host, device), to_device(position_host, device)
    inputs = to_device(batch.inputs[chunk], device)
    sampled = to_device(targets[:, offset:][valid], device)  # (N,)
    with autocast:  # the log-probabilities are computed in fp32 inside, whatever autocast says
        logp, entropy = forward(model, inputs, batch.prompt_length, share_prompt, row_index, position, sampled)  # (N,)
    where = (to_device(chunk[row_host], device), position + offset)  # each token's place in the question's (R, T)
    per_token = lambda row_values: to_device(row_values[chunk][row_host], device)  # (R,) -> (N,)
    token_denominators = per_token(question.denominators).to(logp.dtype)
    if first:
        # on-policy: the ratio is 1, so the clipped surrogate's gradient is A * grad logp (nanochat's term)
        token_weights = per_token(question.weights).to(logp.dtype)
        if batch.sampler_logprobs is not None:
            sampler = to_device(batch.sampler_logprobs[chunk][:, offset:][valid], device)  # (N,)
            correction = _sampler_gap(logp.detach(), sampler, row_index, chunk.numel(), loss, tally)
            if correction is not None:
                token_weights = token_weights * correction
                tally.correction_weights[q][where] = correction
        pg_objective = (logp * token_weights).sum()
        tally.old_logprobs[q][where] = logp.detach()
    else:
        old_logp = tally.old_logprobs[q][where]
        surrogate, ratio, clipped = clipped_surrogate(logp, old_logp, per_token(batch.advantages).to(logp.dtype),
                                                      loss.clip_low, loss.clip_high)
        if tally.correction_weights is not None:  # the first epoch's correction of the sampler's tokens holds
            surrogate = surrogate * tally.correction_weights[q][where]
        pg_objective = (surrogate / token_denominators).sum()
        with torch.no_grad():
            tally.clipped = tally.clipped + clipped.sum()
            tally.approx_kl_sum = tally.approx_kl_sum + ((ratio - 1) - (logp - old_logp)).sum()
    objective = pg_objective
    if loss.kl_coef > 0:
        if first:
            with torch.no_grad(), autocast:
                tally.ref_logprobs[q][where] = forward(reference, inputs, batch.prompt_length, share_prompt, row_index,
                                                       position, sampled)[0]
        kl = k3_kl(logp, tally.ref_logprobs[q][where])  # (N,)
        objective = pg_objective - loss.kl_coef * (kl / token_denominators).sum()
        tally.kl_ref_sum = tally.kl_ref_sum + kl.detach().sum()
    (-objective).backward()
    tally.chunk_sums.append(torch.stack([objective.detach().float(), entropy.float()]))
    tally.chunk_tokens.append(num_tokens)
    tally.tokens += num_tokens
