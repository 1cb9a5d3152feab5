"""
The pieces of the RL algorithm that are pure functions of tensors: turning one question's sampled
completions into a training batch, the advantages, the policy-gradient objective, and the LR schedule.

nanochat's objective, per question with N samples split into P = N / device_batch_size passes:
    adv_i     = r_i - mean(r)                                  (no std division, no KL, no clipping)
    pg_pass   = sum_{rows, t in pass} logp_t * adv_row  /  (valid_targets_in_pass * P * examples_per_rank)
    loss      = -sum over the rank's questions and passes of pg_pass
Gradients are then averaged over ranks by the optimizers, so the objective is a mean over the step's questions.
"""

from dataclasses import dataclass

import torch


@dataclass
class QuestionBatch:
    """One question's samples, ready to train on. R = num_samples rows, T = longest sequence - 1."""
    inputs: torch.Tensor       # (R, T) long: prompt + completion, shifted left
    targets: torch.Tensor      # (R, T) long: next tokens; -1 where the token was not sampled by the policy
    rewards: torch.Tensor      # (R,) float
    advantages: torch.Tensor   # (R,) float: rewards - rewards.mean()
    completion_lengths: list   # (R,) number of generated tokens per row (terminal token excluded)
    prompt_length: int         # tokens of the prompt every row starts with


def advantages_from_rewards(rewards):
    """rewards: (R,) -> (R,) reward minus the question's mean reward."""
    return rewards - rewards.mean()


def make_question_batch(prompt, completions, rewards, pad_token):
    """Build the training tensors for one question.

    prompt: list of token ids; completions: list of (tokens, masks) per sample (mask 1 = sampled,
    0 = forced tool output); rewards: list of floats. Sequences are padded to the longest with
    `pad_token` (mask 0), so padding, the prompt and forced tokens never carry gradient.
    """
    rows = [(list(prompt) + list(toks), [0] * len(prompt) + list(masks)) for toks, masks in completions]
    longest = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), longest), pad_token, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, (row_ids, row_mask) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        mask[i, :len(row_mask)] = torch.tensor(row_mask, dtype=torch.long)
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[mask[:, 1:] == 0] = -1  # the model is only credited for tokens it chose
    rewards = torch.tensor(rewards, dtype=torch.float32)
    return QuestionBatch(inputs=inputs, targets=targets, rewards=rewards,
                         advantages=advantages_from_rewards(rewards),
                         completion_lengths=[len(toks) for toks, _ in completions], prompt_length=len(prompt))


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


def lr_multiplier(step, num_steps):
    """Linear decay from 1 at step 0 to 0 at num_steps."""
    return 1.0 - step / num_steps


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


def accumulate_policy_gradient(model, batches, device_batch_size, examples_per_rank, device, autocast,
                               micro_batch_rows=None):
    """Forward/backward every pass of every question, accumulating gradients into the model.

    batches: this rank's QuestionBatch list; each question's rows are split into passes of
    device_batch_size rows (nanochat's normalization unit). Each pass is computed in chunks of
    micro_batch_rows rows (default: the whole pass) with the pass's own denominator, so a smaller chunk
    (after an out-of-memory) gives the same gradient. The model provides `hidden_states(inputs)` (B, T, C)
    and `logits(hidden)` (..., V), as GPT does.
    Returns (sum of the pass objectives, mean policy entropy over valid tokens) as python floats.
    """
    micro = micro_batch_rows or device_batch_size
    total_objective, entropy_sum, entropy_count = 0.0, 0.0, 0
    for batch in batches:
        num_passes = batch.inputs.size(0) // device_batch_size
        for p in range(num_passes):
            pass_targets = batch.targets[p * device_batch_size:(p + 1) * device_batch_size]
            num_valid = int((pass_targets >= 0).sum())
            for lo in range(p * device_batch_size, (p + 1) * device_batch_size, micro):
                rows = slice(lo, min(lo + micro, (p + 1) * device_batch_size))
                inputs, targets = batch.inputs[rows].to(device), batch.targets[rows].to(device)
                valid = targets >= 0  # (B, T)
                with autocast:
                    # logits only where there is a target (sampled tokens): no vocabulary-wide work for
                    # prompt, forced tool-output and padding positions
                    logits = model.logits(model.hidden_states(inputs)[valid])  # (N, V)
                logp_valid, entropy = token_logprobs_and_entropy(logits, targets[valid])  # (N,)
                logp = torch.zeros(targets.shape, dtype=logp_valid.dtype, device=device).masked_scatter(valid, logp_valid)
                objective = pass_objective(logp, targets, batch.advantages[rows].to(device), num_passes,
                                           examples_per_rank, num_valid=num_valid)
                (-objective).backward()
                total_objective += objective.item()
                chunk_valid = int((targets >= 0).sum())
                entropy_sum += entropy.item() * chunk_valid
                entropy_count += chunk_valid
    return total_objective, entropy_sum / max(1, entropy_count)
