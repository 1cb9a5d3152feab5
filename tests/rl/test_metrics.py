"""Per-step RL metrics on hand-built rollouts, and their cross-rank reduction on 2 gloo processes
against the metrics of the union of both ranks' samples."""

import json
import math
import statistics

import pytest
from gloo_ranks import run_ranks

from nanochat.engine.rows import Completion
from nanochat.rl.metrics import REDUCTIONS, drop_unmeasured, objective_metrics, reduce_metrics, rollout_metrics
from nanochat.rl.policy_gradient import TrainStats


def comp(n_tokens, ended=True, calls=0, successes=0):
    return Completion(tokens=list(range(n_tokens)), masks=[1] * n_tokens, ended=ended,
                      tool_calls=calls, tool_successes=successes)


PROMPTS = [20, 31, 42]  # prompt tokens of the 3 questions of batch()


def batch():
    """3 questions x 3 samples: q0 all right, q1 mixed, q2 all wrong (q0 and q2 give no gradient)."""
    rewards = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    completions = [
        [comp(5), comp(7, calls=1, successes=1), comp(9)],
        [comp(10, ended=False), comp(3, calls=2, successes=1), comp(4)],
        [comp(10, ended=False), comp(2, calls=1, successes=0), comp(8)],
    ]
    return rewards, completions


def test_rollout_metrics_known_values():
    rewards, completions = batch()
    m = rollout_metrics(rewards, completions, max_new_tokens=10, prompt_lengths=PROMPTS)
    flat = [r for q in rewards for r in q]
    assert m["num_samples"] == 9 and m["num_questions"] == 3 and m["num_tool_calls"] == 4
    assert m["reward_mean"] == pytest.approx(4 / 9)
    assert m["reward_std"] == pytest.approx(statistics.pstdev(flat))
    assert m["reward_std"] == pytest.approx(math.sqrt(4 / 9 * 5 / 9))  # Bernoulli: sqrt(p (1 - p))
    assert m["zero_std_fraction"] == pytest.approx(2 / 3)
    assert m["completion_len_mean"] == pytest.approx((5 + 7 + 9 + 10 + 3 + 4 + 10 + 2 + 8) / 9)
    assert m["completion_len_min"] == 2 and m["completion_len_max"] == 10
    # nanochat's "sequence length" is prompt + completion (its engine returns the prompt with each sample)
    assert m["seq_len_mean"] == pytest.approx((3 * 20 + 21 + 3 * 31 + 17 + 3 * 42 + 20) / 9)
    assert m["truncated_fraction"] == pytest.approx(2 / 9)
    assert m["tool_calls_per_sample"] == pytest.approx(4 / 9)
    assert m["tool_success_fraction"] == pytest.approx(2 / 4)
    assert set(m) <= set(REDUCTIONS)  # every metric knows how to combine across ranks (REDUCTIONS also has the objective's)


def test_rollout_metrics_no_tool_calls_and_single_sample():
    """No calls -> success fraction 0.0 (documented), not NaN; one sample -> std 0 and zero_std 1."""
    m = rollout_metrics([[0.5]], [[comp(3)]], max_new_tokens=3, prompt_lengths=[4])
    assert m["seq_len_mean"] == 7.0 and m["completion_len_mean"] == 3.0
    assert m["tool_success_fraction"] == 0.0 and m["tool_calls_per_sample"] == 0.0
    assert m["reward_std"] == 0.0 and m["zero_std_fraction"] == 1.0 and m["truncated_fraction"] == 0.0


def test_rollout_metrics_rejects_mismatched_inputs():
    rewards, completions = batch()
    with pytest.raises(ValueError, match="questions"):
        rollout_metrics(rewards[:2], completions, 10, PROMPTS)
    with pytest.raises(ValueError, match="question 1"):
        rollout_metrics([rewards[0], rewards[1][:2], rewards[2]], completions, 10, PROMPTS)
    with pytest.raises(ValueError, match="max_new_tokens"):
        rollout_metrics(rewards, completions, max_new_tokens=9, prompt_lengths=PROMPTS)
    with pytest.raises(ValueError, match="prompt lengths"):
        rollout_metrics(rewards, completions, 10, PROMPTS[:2])


def test_a_step_that_trained_nothing_has_no_entropy():
    """Regression: a step with no trained token logged entropy NaN (nanochat.rl.policy_gradient's mean over no tokens)."""
    trained = TrainStats(objective=0.5, entropy=1.25, rows_trained=2, rows_total=4, tokens=7)
    idle = TrainStats(objective=0.0, entropy=float("nan"), rows_trained=0, rows_total=4, tokens=0)
    assert drop_unmeasured(objective_metrics(trained, trained))["entropy"] == 1.25
    metrics = drop_unmeasured(objective_metrics(idle, idle))
    assert "entropy" not in metrics and all(v == v for v in metrics.values())  # and no NaN left


def test_reduce_metrics_without_process_group_is_identity():
    rewards, completions = batch()
    m = rollout_metrics(rewards, completions, 10, PROMPTS)
    assert reduce_metrics(m) is m


# Uneven ranks: rank 0 has 1 question x 4 samples, all of them long and no tool calls; rank 1 has
# 3 questions x 2 samples, short, with calls. A per-rank average would be wrong on every metric.
RANK_DATA = [
    {"rewards": [[1.0, 0.0, 1.0, 1.0]], "prompts": [50],
     "completions": [[[20, True, 0, 0], [30, False, 0, 0], [25, True, 0, 0], [22, True, 0, 0]]],
     "trained": [[30, 2.0], [0, 0.0]]},  # (tokens, entropy) of two steps: this rank trains in the first only
    {"rewards": [[0.0, 0.0], [1.0, 0.0], [0.5, 0.5]], "prompts": [9, 12, 15],
     "completions": [[[3, True, 1, 1], [4, True, 0, 0]], [[5, True, 2, 0], [30, False, 0, 0]],
                     [[6, True, 1, 1], [2, True, 0, 0]]],
     "trained": [[0, float("nan")], [0, float("nan")]]},  # trains nothing: nanochat.rl.policy_gradient's entropy is NaN then
]

WORKER = """
import json, sys
import torch.distributed as dist
from nanochat.engine.rows import Completion
from nanochat.rl.metrics import drop_unmeasured, objective_metrics, reduce_metrics, rollout_metrics
from nanochat.rl.policy_gradient import TrainStats
data, out = json.loads(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
completions = [[Completion(list(range(n)), [1] * n, ended, calls, ok) for n, ended, calls, ok in q]
               for q in data["completions"]]
local = rollout_metrics(data["rewards"], completions, max_new_tokens=30, prompt_lengths=data["prompts"])
reduced = reduce_metrics(local, "cpu")
steps = []
for tokens, entropy in data["trained"]:
    stats = TrainStats(objective=0.0, entropy=entropy, rows_trained=1 if tokens else 0, rows_total=4, tokens=tokens)
    steps.append(drop_unmeasured(reduce_metrics({**objective_metrics(stats, stats), "num_questions": 1.0}, "cpu")))
dist.destroy_process_group()
json.dump({"local": local, "reduced": reduced, "steps": steps}, open(out, "w"))
"""


def to_completions(rows):
    return [[comp(n, ended, calls, ok) for n, ended, calls, ok in q] for q in rows]


def test_reduce_metrics_two_ranks_equals_union(tmp_path):
    run_ranks(lambda rank: ["-c", WORKER, json.dumps(RANK_DATA[rank]), str(tmp_path / f"rank{rank}.json")], timeout=30)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    union = rollout_metrics(RANK_DATA[0]["rewards"] + RANK_DATA[1]["rewards"],
                            to_completions(RANK_DATA[0]["completions"]) + to_completions(RANK_DATA[1]["completions"]),
                            max_new_tokens=30, prompt_lengths=RANK_DATA[0]["prompts"] + RANK_DATA[1]["prompts"])
    assert results[0]["reduced"] == results[1]["reduced"]  # every rank gets the same numbers
    for key, want in union.items():
        assert results[0]["reduced"][key] == pytest.approx(want, rel=1e-12, abs=1e-12), key

    # the entropy is the mean over every rank's trained tokens (rank 1 trained none: not a NaN, not half of rank 0's);
    # a step no rank trained in has none
    entropies = [[s.get("entropy") for s in result["steps"]] for result in results]
    assert entropies == [[2.0, None], [2.0, None]]

    # the data is uneven enough that averaging per-rank values would have been caught
    naive = {k: (results[0]["local"][k] + results[1]["local"][k]) / 2 for k in union}
    for key in ("reward_mean", "reward_std", "zero_std_fraction", "seq_len_mean", "completion_len_mean", "truncated_fraction",
                "tool_calls_per_sample", "tool_success_fraction"):
        assert naive[key] != pytest.approx(union[key], abs=1e-6), key
