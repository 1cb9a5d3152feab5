"""
One question's sampled completions -> a training batch: the prompt and completions as (inputs, targets) rows, each
target -1 where the policy did not sample the token (prompt, forced tool output, padding), and each row's advantage
(its reward minus the question's mean reward; nanochat: no std division).
"""

from dataclasses import dataclass

import torch

from nanochat.tokenizer import collate_rows


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
