"""
Per-step RL metrics: what the rollouts of one step looked like, computed from plain python data and
combined across ranks exactly (as if one process had seen every rank's samples).

`rollout_metrics` (and `objective_metrics`) summarize one rank's step; `reduce_metrics` combines the ranks' summaries. Each
metric declares in REDUCTIONS how it combines, so a mean is weighted by its count and a fraction sums
its numerator and denominator, instead of averaging per-rank values (which is wrong for uneven ranks).

Keys of a metrics dict (all floats):
  reward_mean, reward_std    over every sample of the step (population std, ddof=0)
  zero_std_fraction          questions whose samples all got the same reward: advantage 0, no gradient
  seq_len_mean               prompt + generated tokens per sample: nanochat's "sequence length"
  completion_len_mean/min/max   generated tokens per sample (sampled and tool-forced; terminal token excluded)
  truncated_fraction         samples cut at max_new_tokens instead of ending themselves
  tool_calls_per_sample      calculator calls per sample
  tool_success_fraction      calls that returned a value / calls (0.0 when there were no calls, see below)
  num_samples, num_questions, num_tool_calls   the counts the other metrics are weighted by
  rows_trained               samples that went through the training forward/backward (non-zero advantage)
  captures                   decode shapes the step's rollouts captured into CUDA graphs (static decode: shapes a
                             new batch would capture); 0 once a run's batch is kept (the most of any rank)
  compiles, compile_s        graphs torch.compile made during the step (decode step and training forward) and the
                             seconds of the calls that made them (nanochat/compiling/functions.py; the most of any rank)
The objective's diagnostics (`objective_metrics`, from nanochat.rl.policy_gradient.TrainStats), when they apply:
  loss                       minus the on-policy objective (the step's, averaged over ranks like the gradients)
  trained_tokens             sampled tokens of the trained rows (their weight)
  entropy                    mean policy entropy over those tokens; absent where no token was trained (see MEASURED_OVER)
  clip_fraction, approx_kl   last PPO epoch: tokens whose ratio was clipped; mean (rho - 1) - log rho
  kl_ref                     mean k3 KL of the policy to the reference model (--kl-coef)
  reverse_kl, teacher_logprob   with --teacher: mean over the trained tokens of logp_student - logp_teacher (the
                             per-token reverse KL the distillation lowers) and of logp_teacher
The sampler-trainer gap, over the trained tokens (the first epoch's forward against the engine's log-probabilities):
  sampler_tokens             trained tokens that have a sampler log-probability (their weight)
  sampler_gap_mean/max       mean and max |logp_trainer - logp_sampler|
  sampler_k3                 mean k3 estimate of KL(sampler || trainer): exp(d) - d - 1, d = logp_trainer - logp_sampler
  corrected_fraction         tokens the rollout correction changed (token-tis: weight capped; sequence-mask: row dropped)
"""

import math

import torch
import torch.distributed as dist

# key -> (how it combines across ranks, the count key that weights it)
#   "sum": add;  "mean": weighted by the count;  "std": population std of the union (needs the mean);
#   "min"/"max": min/max over ranks
REDUCTIONS = {
    "num_samples": ("sum", None),
    "num_questions": ("sum", None),
    "questions_trained": ("sum", None),  # --dynamic-sampling: of the num_questions drawn
    "num_tool_calls": ("sum", None),
    "reward_mean": ("mean", "num_samples"),
    "reward_std": ("std", "num_samples"),
    "zero_std_fraction": ("mean", "num_questions"),
    "seq_len_mean": ("mean", "num_samples"),
    "completion_len_mean": ("mean", "num_samples"),
    "completion_len_min": ("min", None),
    "completion_len_max": ("max", None),
    "truncated_fraction": ("mean", "num_samples"),
    "tool_calls_per_sample": ("mean", "num_samples"),
    "tool_success_fraction": ("mean", "num_tool_calls"),
    "rows_trained": ("sum", None),
    "captures": ("max", None),
    "compiles": ("max", None),
    "compile_s": ("max", None),
    "loss": ("mean", "num_questions"),  # every rank has the same number of questions: the plain rank mean
    "trained_tokens": ("sum", None),
    "entropy": ("mean", "trained_tokens"),
    "clip_fraction": ("mean", "trained_tokens"),
    "approx_kl": ("mean", "trained_tokens"),
    "kl_ref": ("mean", "trained_tokens"),
    "reverse_kl": ("mean", "trained_tokens"),
    "teacher_logprob": ("mean", "trained_tokens"),
    "sampler_tokens": ("sum", None),
    "sampler_gap_mean": ("mean", "sampler_tokens"),
    "sampler_gap_max": ("max", None),
    "sampler_k3": ("mean", "sampler_tokens"),
    "corrected_fraction": ("mean", "sampler_tokens"),
}
_STD_MEAN = {"reward_std": "reward_mean"}  # a "std" metric and the mean it is taken around
# a mean that measures nothing when its count is 0 -> that count: `drop_unmeasured` leaves it out then, so a step
# that trained no row logs no entropy (not NaN, which charts as a gap at best, nor a 0 that reads like a measurement)
MEASURED_OVER = {"entropy": "trained_tokens"}


def rollout_metrics(rewards_per_question, completions_per_question, max_new_tokens, prompt_lengths, rows_trained=0):
    """Summarize one rank's rollouts of one step.

    rewards_per_question: [question][sample] float rewards.
    completions_per_question: [question][sample] `nanochat.engine.engine.Completion` (same shape as the rewards).
    max_new_tokens: the length cap the rollouts were sampled with; a completion longer than it means the
        arguments do not belong together, and is refused.
    prompt_lengths: [question] prompt tokens; nanochat's sequence length counts them with the completion.
    rows_trained: how many of these samples the training step ran (see nanochat.rl.policy_gradient.TrainStats).
    Returns a dict with the keys listed in this module's docstring.

    tool_success_fraction is 0.0 when no sample called the tool: a rate of successes should not read as
    perfect when nothing succeeded, and a plot stays free of NaN gaps; tool_calls_per_sample (0 then)
    tells "no calls" apart from "every call failed". The cross-rank reduction weights it by
    num_tool_calls, so a rank without calls does not pull the combined value toward 0.
    """
    _check_questions(rewards_per_question, completions_per_question, prompt_lengths)
    rewards, lengths, prompt_tokens = [], [], 0
    zero_std = truncated = calls = successes = 0
    for q, (question_rewards, completions) in enumerate(zip(rewards_per_question, completions_per_question)):
        if len(question_rewards) != len(completions) or not completions:
            raise ValueError(f"question {q}: {len(question_rewards)} rewards for {len(completions)} completions; "
                             f"need one reward per completion and at least one completion")
        question_rewards = [float(r) for r in question_rewards]
        zero_std += max(question_rewards) == min(question_rewards)
        rewards.extend(question_rewards)
        prompt_tokens += prompt_lengths[q] * len(completions)
        for c in completions:
            if len(c.tokens) > max_new_tokens:
                raise ValueError(f"question {q}: a completion has {len(c.tokens)} tokens, more than "
                                 f"max_new_tokens={max_new_tokens}; pass the cap the rollouts were sampled with")
            lengths.append(len(c.tokens))
            truncated += not c.ended
            calls += c.tool_calls
            successes += c.tool_successes
    n = len(rewards)
    mean = sum(rewards) / n
    return {
        "num_samples": float(n),
        "num_questions": float(len(rewards_per_question)),
        "num_tool_calls": float(calls),
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "zero_std_fraction": zero_std / len(rewards_per_question),
        "seq_len_mean": (prompt_tokens + sum(lengths)) / n,
        "completion_len_mean": sum(lengths) / n,
        "completion_len_min": float(min(lengths)),
        "completion_len_max": float(max(lengths)),
        "truncated_fraction": truncated / n,
        "tool_calls_per_sample": calls / n,
        "tool_success_fraction": successes / calls if calls else 0.0,
        "rows_trained": float(rows_trained),
    }


def _check_questions(rewards_per_question, completions_per_question, prompt_lengths):
    """rollout_metrics' arguments describe the same questions, at least one (each question's own lengths are checked
    as it is read)."""
    if len(rewards_per_question) != len(completions_per_question):
        raise ValueError(f"{len(rewards_per_question)} questions of rewards but {len(completions_per_question)} "
                         f"of completions; pass both for the same questions")
    if not rewards_per_question:
        raise ValueError("rollout_metrics needs at least one question")
    if len(prompt_lengths) != len(rewards_per_question):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(rewards_per_question)} questions; "
                         f"pass one per question")


def objective_metrics(first, last):
    """The objective's diagnostics from one step's TrainStats (nanochat.rl.objective): the first epoch's loss (minus the objective;
    the ranks' mean is the step's, as the optimizers average gradients), its trained tokens, its sampler-trainer
    gap and its mean KL to the reference (with --kl-coef), the last PPO epoch's clipped fraction and KL from the
    old policy (measured in its forward, after the earlier epochs' updates). The gap's keys are there on every
    rank, with weight 0 where nothing was trained, so that ranks reduce the same keys; so is the entropy (0.0 with
    weight 0 there, and dropped by drop_unmeasured when no rank trained a token)."""
    out = {"loss": -first.objective, "trained_tokens": float(first.tokens),
           "entropy": first.entropy if first.tokens else 0.0, "sampler_tokens": float(first.sampler_tokens),
           "sampler_gap_mean": first.sampler_gap_mean, "sampler_gap_max": first.sampler_gap_max,
           "sampler_k3": first.sampler_k3, "corrected_fraction": first.corrected_fraction}
    if last.clip_fraction is not None:
        out.update(clip_fraction=last.clip_fraction, approx_kl=last.approx_kl)
    if first.kl_ref is not None:
        out["kl_ref"] = first.kl_ref
    if getattr(first, "reverse_kl", None) is not None:  # --teacher (stats of a run without one may lack the field)
        out.update(reverse_kl=first.reverse_kl, teacher_logprob=first.teacher_logprob)
    return out


def drop_unmeasured(metrics):
    """`metrics` without the MEASURED_OVER means whose count is 0 (or absent): what a step logs."""
    return {k: v for k, v in metrics.items() if k not in MEASURED_OVER or metrics.get(MEASURED_OVER[k])}


def reduce_metrics(metrics, device="cpu"):
    """Combine every rank's `metrics` (same keys on every rank) into the metrics of the union of their
    samples, identical on every rank. Without a process group, returns `metrics` unchanged.

    Means are weighted by their count key, fractions sum numerator and denominator, min/max use a
    MIN/MAX all_reduce, and reward_std is rebuilt from per-rank sums of squares. Three collectives in
    all, whatever the number of keys. `device` must be the rank's compute device under NCCL.
    Every key must be in REDUCTIONS (an unknown key has no safe default), with its count key present.
    """
    if not dist.is_initialized():
        return metrics
    unknown = sorted(k for k in metrics if k not in REDUCTIONS)
    if unknown:
        raise ValueError(f"reduce_metrics does not know how to combine {unknown}; add them to "
                         f"nanochat.rl.metrics.REDUCTIONS, or reduce them yourself (e.g. distributed.all_reduce_mean)")
    keys = [k for k in REDUCTIONS if k in metrics]  # a fixed order, the same on every rank
    for k in keys:
        kind, weight = REDUCTIONS[k]
        needed = [weight] + ([_STD_MEAN[k]] if kind == "std" else [])
        missing = [w for w in needed if w is not None and w not in metrics]
        if missing:
            raise ValueError(f"reduce_metrics: {k} needs {missing} in the same dict to be combined")

    # per key, what to sum: counts as they are, a mean times its count, a std as its sum of squares
    sums, mins, maxs = [], [], []
    for k in keys:
        kind, weight = REDUCTIONS[k]
        v = float(metrics[k])
        if kind == "sum":
            sums.append(v)
        elif kind == "mean":
            sums.append(v * metrics[weight])
        elif kind == "std":
            m = float(metrics[_STD_MEAN[k]])
            sums.append((v * v + m * m) * metrics[weight])  # n * E[x^2]
        elif kind == "min":
            mins.append(v)
        else:
            maxs.append(v)
    out = {}
    totals = _all_reduce(sums, dist.ReduceOp.SUM, device)
    lows = _all_reduce(mins, dist.ReduceOp.MIN, device)
    highs = _all_reduce(maxs, dist.ReduceOp.MAX, device)
    for k in keys:
        kind = REDUCTIONS[k][0]
        out[k] = lows.pop(0) if kind == "min" else highs.pop(0) if kind == "max" else totals.pop(0)
    # counts are final now; turn the weighted sums back into means
    for k in keys:
        kind, weight = REDUCTIONS[k]
        if kind in ("mean", "std"):
            out[k] = out[k] / out[weight] if out[weight] else 0.0
    for k in keys:
        if REDUCTIONS[k][0] == "std":
            m = out[_STD_MEAN[k]]
            out[k] = math.sqrt(max(out[k] - m * m, 0.0))  # max: rounding can make a zero variance slightly negative
    return out


def _all_reduce(values, op, device):
    if not values:
        return []
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()
