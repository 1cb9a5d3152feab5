"""--save-rollouts' records (nanochat/rl/progress.py's RolloutLog) field by field against what was sampled, on
rollouts where every field varies: rows that end early (some at their first token), rows that call the calculator
(its output forced, mask 0), rows cut at the length cap, rewards that differ within a question. The chat_rl test of
the file (tests/checkpoints/test_resume.py) runs a random model whose samples are all cut and call no tool, where a `length` off
by one went unnoticed."""

import json
from types import SimpleNamespace

import torch
from test_decode_lag import BIGRAM_PROMPTS, bigram_model

from nanochat.engine.engine import Engine
from nanochat.engine.rows import Completion
from nanochat.rl.progress import RolloutLog, rollout_lines
from nanochat.rl.rollout import QuestionRollout, Sampling, sample_questions

MAX_NEW_TOKENS = 12
NUM_SAMPLES = 6


class PromptTask:
    """BIGRAM_PROMPTS as a task's questions; a text's reward is its length in characters mod 3, halved, so a
    question's samples earn different rewards."""

    def __len__(self):
        return len(BIGRAM_PROMPTS)

    def __getitem__(self, i):
        return {"messages": [{"role": "user", "content": BIGRAM_PROMPTS[i]}, {"role": "assistant", "content": ""}]}

    def reward(self, conversation, text):
        return (len(text) % 3) / 2


def completed_calls(tokens, start, end):
    """<|python_start|> ... <|python_end|> pairs in `tokens`: the calls the row made, counted here from the tokens."""
    calls, inside = 0, False
    for token in tokens:
        if token == start:
            inside = True
        elif token == end and inside:
            calls, inside = calls + 1, False
    return calls


def test_each_saved_record_is_what_its_sample_was(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    special = {name: tok.encode_special(f"<|{name}|>") for name in ("python_start", "python_end", "output_start")}
    indices = list(range(len(BIGRAM_PROMPTS)))
    rollouts = sample_questions(Engine(bigram_model(tok), tok), PromptTask(), indices, [1, 2, 3, 4, 5],
                                Sampling(num_samples=NUM_SAMPLES, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0,
                                         top_k=0))
    log = RolloutLog(str(tmp_path), rank=0, resumed=False)
    log.append(7, rollouts)
    lines = [json.loads(line) for line in (tmp_path / "rollouts_rank0.jsonl").read_text().splitlines()]
    assert [(line["step"], line["question"], line["sample"]) for line in lines] == [
        (7, q, j) for q in indices for j in range(NUM_SAMPLES)]
    completions = [c for r in rollouts for c in r.completions]
    for q, question in enumerate(indices):
        records = lines[NUM_SAMPLES * q:NUM_SAMPLES * (q + 1)]
        mean = sum(r["reward"] for r in records) / NUM_SAMPLES
        for record, c in zip(records, completions[NUM_SAMPLES * q:NUM_SAMPLES * (q + 1)]):
            text = tok.decode(c.tokens)
            where = f"question {question} sample {record['sample']}"
            assert record["text"] == text, where
            assert record["reward"] == (len(text) % 3) / 2, where
            assert abs(record["advantage"] - (record["reward"] - mean)) < 1e-6, where
            # every emitted token but a terminal one is the completion's: a row cut at the cap has exactly the cap
            assert record["length"] == len(c.tokens) == len(c.masks), (where, record["length"], len(c.tokens))
            assert record["ended"] == (record["length"] < MAX_NEW_TOKENS), (where, record)
            calls = completed_calls(c.tokens, special["python_start"], special["python_end"])
            assert record["tool_calls"] == calls, (where, record["tool_calls"], calls)
            forced_outputs = sum(t == special["output_start"] and m == 0 for t, m in zip(c.tokens, c.masks))
            # a call's output is forced after it, unless the cap cut the row right at its <|python_end|>
            cut_at_call = bool(c.tokens) and c.tokens[-1] == special["python_end"] and not c.ended
            assert forced_outputs <= record["tool_successes"] <= forced_outputs + cut_at_call, (where, record)
    # the records vary in every field
    assert {line["ended"] for line in lines} == {True, False}
    assert any(line["length"] == 0 for line in lines) and len({line["length"] for line in lines}) > 3
    assert sum(line["tool_calls"] > 0 for line in lines) >= 2 and sum(line["tool_successes"] for line in lines) >= 2
    assert len({line["reward"] for line in lines}) > 1 and any(line["advantage"] != 0 for line in lines)


def test_each_field_comes_from_its_own_source():
    """Hand-made rollouts whose every field differs from every other (a call that failed: 2 calls, 1 success; a row
    that ended and one cut; rewards and advantages apart), against records written out by hand: a field read from
    its neighbour (successes from calls, the sample from the question) is seen, which sampled rollouts, whose calls
    all succeed, would not show."""
    batch = SimpleNamespace(advantages=torch.tensor([0.25, -0.25]))  # the one field of QuestionBatch a record reads
    rollout = QuestionRollout(index=9, completions=[Completion([5, 6, 7], [1, 0, 1], ended=True, tool_calls=2,
                                                               tool_successes=1),
                                                    Completion([8] * 5, [1] * 5, ended=False)],
                              texts=["abc", "ddddd"], rewards=[0.75, 0.25], batch=batch)
    assert [json.loads(line) for line in rollout_lines(4, [rollout]).splitlines()] == [
        {"step": 4, "question": 9, "sample": 0, "text": "abc", "reward": 0.75, "advantage": 0.25, "length": 3,
         "ended": True, "tool_calls": 2, "tool_successes": 1},
        {"step": 4, "question": 9, "sample": 1, "text": "ddddd", "reward": 0.25, "advantage": -0.25, "length": 5,
         "ended": False, "tool_calls": 0, "tool_successes": 0}]
