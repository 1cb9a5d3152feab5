"""
The training pass of one step on one rank: each question's rows in chunks through the model, the objective of
nanochat/rl/objective.py summed and backpropagated chunk by chunk (gradients accumulate; the optimizer steps
elsewhere), and what the pass saw (TrainStats).
"""

import math
from dataclasses import dataclass, field

import torch

from nanochat.common import to_device
from nanochat.rl.advantages import QuestionBatch
from nanochat.rl.objective import (PolicyLoss, clipped_surrogate, counted_rows, k3_kl, row_denominators, step_counts,
                                   token_logprobs_and_entropy, trainable_targets)


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
    with no host read: nanochat/model/compile.py compiles it (dynamic shapes) for the policy, PPO and reference
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
