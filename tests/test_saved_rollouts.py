"""--save-rollouts' records (nanochat/rl/progress.py's RolloutLog) field by field against what was sampled, on
rollouts where every field varies: rows that end early (some at their first token), rows that call the calculator
(its output forced, mask 0), rows cut at the length cap, rewards that differ within a question. The chat_rl test of
the file (tests/test_resume.py) runs a random model whose samples are all cut and call no tool, where a `length` off
by one went unnoticed."""

import json

from test_decode_lag import BIGRAM_PROMPTS, bigram_model

from nanochat.engine.engine import Engine
from nanochat.rl.progress import RolloutLog
from nanochat.rl.rollout import Sampling, sample_questions

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
    indices = [0, 1, 3]
    rollouts = sample_questions(Engine(bigram_model(tok), tok), PromptTask(), indices, [11, 12, 13],
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
