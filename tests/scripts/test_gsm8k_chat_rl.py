"""chat_rl on its default task, GSM8K (the committed 12 train / 8 test fixture), for two steps with nanochat's
flags scaled down: every reward recomputed from the decoded completions, the step lines and the run's history
checked against them, and the pass@k eval against values worked out by hand, on 1 rank and on 2 gloo ranks.

A tiny random model never writes a GSM8K answer, so tests/support/scripted_gsm8k.py replaces a few rows of each
question with known answer texts (by the question's fixture line L: see that module); every other row is the
model's own sample, decoded by the real engine with the calculator."""

import json

import pytest
import scripted_gsm8k
from gloo_ranks import run_ranks

from scripts import chat_rl
from tasks.gsm8k import GSM8K

# nanochat's defaults scaled down (16 questions x 16 samples, 8 rows a pass, 256 tokens); no --task: gsm8k
FLAGS = ["--device-type=cpu", "--dtype=float32", "--num-steps=2", "--examples-per-step=4", "--num-samples=4",
         "--device-batch-size=2", "--max-new-tokens=32", "--eval-examples=8"]

# What the scripted rows must earn, by the rule L % 4 (scripted_gsm8k): {sample: reward}
SCRIPTED_REWARDS = {
    3: {0: 1.0, 1: 0.0},  # "#### 1080" for a reference "1,080" is right (commas ignored); the answer + 1 is wrong
    0: {1: 1.0},          # right after a calculator call (whose output tokens are forced, mask 0)
    1: {1: 1.0},          # right, negative answers included ("#### -7")
    2: {},
}

# The eval: the 8 test questions (lines 0-7) x 2 samples (--device-batch-size). Lines 3, 7: sample 0 right,
# sample 1 wrong; lines 0, 4 and 1, 5: sample 1 right; lines 2, 6: nothing right (the model's samples).
#   pass@1 ("any": sample 0 right)           2 of 8 questions          = 1/4
#   pass@2 ("any": sample 0 or 1 right)      6 of 8                    = 3/4
#   pass@1 unbiased (mean of c/n, n = 2)     6 questions x 1/2, / 8    = 3/8
#   pass@2 unbiased (1 - C(2-c,2)/C(2,2))    6 questions x 1, / 8      = 3/4
EXPECTED_PASS_AT_K = {"pass@1": 0.25, "pass@2": 0.75, "pass@1_unbiased": 0.375, "pass@2_unbiased": 0.75}


def final_meta(base_dir):
    """The last checkpoint's meta (step 1; --save-every's default 60 saves only the last step)."""
    return json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000001.json").read_text())


def recomputed_step(tokenizer, call):
    """From one rollout call (questions, completions): the rewards per question recomputed with tasks/gsm8k.py
    on the decoded texts, checked against SCRIPTED_REWARDS on the scripted rows; and the step's lengths and
    tool calls. Returns a dict of what the step's record must say."""
    task = GSM8K(split="train")
    by_text = {task[i]["messages"][0]["content"]: task[i] for i in range(len(task))}
    questions, results = call
    rewards, lengths, tool_calls = [], [], 0
    for question, completions in zip(questions, results):
        assert question.split == "train"
        conversation = by_text[question.question]
        got = [task.reward(conversation, tokenizer.decode(c.tokens)) for c in completions]
        for sample, reward in SCRIPTED_REWARDS[question.line % 4].items():
            assert got[sample] == reward, (question, sample, tokenizer.decode(completions[sample].tokens))
        rewards.append(got)
        lengths += [len(c.tokens) for c in completions]
        tool_calls += sum(c.tool_calls for c in completions)
    flat = [r for rs in rewards for r in rs]
    mean = sum(flat) / len(flat)
    mixed = [rs for rs in rewards if max(rs) != min(rs)]  # the questions with a training signal
    return {"reward": mean, "reward_std": (sum((r - mean) ** 2 for r in flat) / len(flat)) ** 0.5,
            "zero_std_fraction": 1 - len(mixed) / len(rewards), "rows_trained": float(sum(len(rs) for rs in mixed)),
            "num_samples": float(len(flat)), "num_questions": float(len(rewards)),
            "completion_length": sum(lengths) / len(lengths), "tool_calls_per_sample": tool_calls / len(flat)}


def test_two_gsm8k_steps_log_the_rewards_of_what_was_sampled(sft, base_dir, tiny_tokenizer, monkeypatch, capsys):
    calls = scripted_gsm8k.install(monkeypatch)
    chat_rl.main(FLAGS)
    out = capsys.readouterr().out
    assert "Calculated number of steps: 2" in out
    train_calls = [c for c in calls if c[0][0].split == "train"]
    assert len(train_calls) == 2 and len(calls) == 4  # 2 steps of rollouts, the evals at steps 0 and 2
    history = final_meta(base_dir)["history"]
    assert [record["step"] for record in history] == [0, 1]
    seen = set()
    for step, (call, record) in enumerate(zip(train_calls, history)):
        want = recomputed_step(tiny_tokenizer, call)
        seen |= {q.line for q in call[0]}
        line = next(l for l in out.splitlines() if l.startswith(f"Step {step}/2 |"))
        assert f"Average reward: {want['reward']:.4f} |" in line, line
        assert f"No-signal questions: {want['zero_std_fraction']:.0%} |" in line
        assert f"Rows trained: {want['rows_trained']:.0f}/16 |" in line
        assert f"Average completion length: {want['completion_length']:.2f} (" in line
        for key, value in want.items():
            assert record[key] == pytest.approx(value, abs=1e-9), (step, key)
    assert len(seen) == 8  # two steps, eight different train questions
    assert sum(r["reward"] for r in history) > 0 and sum(r["rows_trained"] for r in history) > 0

    # the eval: before the first step and after the last, on the test split, against the hand-computed values
    assert final_meta(base_dir)["eval_history"] == [[0, EXPECTED_PASS_AT_K], [2, EXPECTED_PASS_AT_K]]
    for step in (0, 2):
        assert f"Step {step} | Pass@1: 0.2500, Pass@2: 0.7500 |" in out


@pytest.mark.slow
def test_two_gloo_ranks_give_the_one_rank_rewards_and_pass_at_k(sft, base_dir, monkeypatch):
    """The same GSM8K run on 2 ranks: each rank samples half of each step's questions and half of the eval's,
    and the logged rewards and pass@k (summed over ranks) are the 1-rank run's."""
    scripted_gsm8k.install(monkeypatch)
    chat_rl.main(FLAGS)
    one = final_meta(base_dir)
    run_ranks(lambda rank: ["tests/support/scripted_gsm8k.py", *FLAGS, "--overwrite"], timeout=300)
    two = final_meta(base_dir)
    assert two["user_config"]["task"] == "gsm8k"
    assert two["eval_history"] == one["eval_history"] == [[0, EXPECTED_PASS_AT_K], [2, EXPECTED_PASS_AT_K]]
    for a, b in zip(one["history"], two["history"]):
        for key in ("reward", "reward_std", "zero_std_fraction", "rows_trained", "num_samples", "tool_calls_per_sample"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), key
