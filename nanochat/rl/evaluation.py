"""
pass@k evaluation of a chat model on a generative task, shared by chat_rl (periodic eval) and chat_eval.

Two definitions of pass@k are reported:
- "any" (nanochat's): the fraction of questions with a correct answer among the first k samples.
- "unbiased" (Chen et al. 2021): with n samples of which c are correct, 1 - C(n-c, k) / C(n, k): the
  probability that k samples drawn without replacement contain a correct one. Lower variance than "any".
"""

from dataclasses import dataclass
from math import comb

import torch
import torch.distributed as dist

from nanochat.rl.rollout import Sampling, sample_questions
from nanochat.runtime.distributed import rank_and_world, rank_share, reduction_dtype
from nanochat.settings import SHARED

# How the pass@k eval samples where not told otherwise: nanochat's chat_rl eval, whose sampling is fixed whatever the
# run's rollout flags (Sampling's defaults), question i seeded with EVAL_SEED + i. chat_rl's periodic eval samples so,
# chat_eval's and bench_eval's flags default to it (nanochat/settings.py), and chat_sft's held-out checks follow it.
EVAL_MAX_NEW_TOKENS, EVAL_TEMPERATURE, EVAL_TOP_K = Sampling.max_new_tokens, Sampling.temperature, Sampling.top_k
EVAL_SEED = SHARED["seed"].default


@dataclass
class PassAtK:
    """pass@k for k = 1..num_samples, aggregated over every rank's questions."""
    num_questions: int
    any: list                  # any[k-1]: nanochat's pass@k
    unbiased: list             # unbiased[k-1]

    def as_dict(self, prefix=""):
        out = {f"{prefix}pass@{k + 1}": v for k, v in enumerate(self.any)}
        out.update({f"{prefix}pass@{k + 1}_unbiased": v for k, v in enumerate(self.unbiased)})
        return out


def unbiased_pass_at_k(n, c, k):
    """1 - C(n-c, k) / C(n, k): the chance that k of n samples (c correct) include a correct one."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def sample_outcomes(engine, task, indices, num_samples, max_new_tokens, temperature, top_k, seed=EVAL_SEED):
    """Sample num_samples answers for each task question in `indices` (one batched rollout) and grade them
    with task.evaluate: [QuestionRollout] whose rewards are 1.0 (correct) or 0.0. Question i is seeded with
    seed + i, so its samples do not depend on the rank layout."""
    sampling = Sampling(num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0)
    return sample_questions(engine, task, indices, [seed + i for i in indices], sampling, score=task.evaluate, label="eval")


def aggregate_pass_at_k(outcomes, num_samples, device="cpu"):
    """Sum per-k counts over this rank's questions, then over ranks; returns PassAtK."""
    counts = torch.zeros(2 * num_samples + 1, dtype=reduction_dtype(device), device=device)
    for o in outcomes:
        correct = [int(r) for r in o.rewards]
        c = sum(correct)
        for k in range(1, num_samples + 1):
            counts[k - 1] += float(any(correct[:k]))
            counts[num_samples + k - 1] += unbiased_pass_at_k(num_samples, c, k)
    counts[-1] = len(outcomes)
    if dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    total = max(1.0, counts[-1].item())
    values = (counts[:-1] / total).tolist()
    return PassAtK(num_questions=int(counts[-1].item()), any=values[:num_samples], unbiased=values[num_samples:])


def evaluate_pass_at_k(engine, task, num_examples, num_samples, max_new_tokens=EVAL_MAX_NEW_TOKENS,
                       temperature=EVAL_TEMPERATURE, top_k=EVAL_TOP_K, device="cpu", seed=EVAL_SEED):
    """pass@k on the first `num_examples` questions of `task`, split across the ranks of the process group.
    Returns (PassAtK, this rank's [QuestionRollout])."""
    num_examples = min(num_examples, len(task))
    indices = list(rank_share(0, num_examples, *rank_and_world()))
    outcomes = sample_outcomes(engine, task, indices, num_samples, max_new_tokens, temperature=temperature, top_k=top_k,
                               seed=seed)
    return aggregate_pass_at_k(outcomes, num_samples, device=device), outcomes
