"""A GSM8K rollout stand-in: chat_rl's engine with some rows replaced by known answer texts.

A tiny random model never writes a GSM8K answer, so a run on GSM8K would reward nothing and train nothing.
`install` wraps Engine.generate_many: the real engine samples every prompt (calculator and all), then some
rows are replaced, chosen by the question's line L in the committed fixture (tests/fixtures/gsm8k/<split>.jsonl;
the reference's final answer is the text after "#### ", e.g. "1,080"):

    L % 4 == 3   sample 0 writes the answer without its commas ("So the answer is\n#### 1080" for "1,080"),
                 sample 1 a wrong one (the answer + 1)
    L % 4 == 0   sample 1 calls the calculator, then writes the answer as written ("\n#### 2,125")
    L % 4 == 1   sample 1 writes the answer as written
    L % 4 == 2   nothing: the model's own samples only

The rule depends only on the question, so every rank layout sees the same rows. The tests recompute each
reward from the decoded text; what a scripted row should earn is written out in the tests, not here.

As a script it is chat_rl with the stand-in installed (for torchrun / gloo_ranks):
    python tests/support/scripted_gsm8k.py [chat_rl flags]
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k"


@dataclass
class Question:
    split: str       # the fixture file it is in: train or test
    line: int        # its 0-based line in that file
    question: str
    answer: str      # the reference's final answer as written after "#### " (may hold commas, a minus sign)


def fixture_questions():
    rows = []
    for split in ("train", "test"):
        for line, text in enumerate((FIXTURE / f"{split}.jsonl").read_text().splitlines()):
            row = json.loads(text)
            rows.append(Question(split, line, row["question"], row["answer"].split("#### ")[-1].strip()))
    return rows


def question_of(tokenizer, prompt, questions):
    """The fixture question whose text the prompt holds."""
    text = tokenizer.decode(prompt)
    found = [q for q in questions if q.question in text]
    assert len(found) == 1, f"prompt matches {len(found)} fixture questions: {text[:200]!r}"
    return found[0]


def scripted_rows(tokenizer, question):
    """{sample: (tokens, masks, tool_calls)} of the rows the rule replaces for this question."""
    special = lambda name: tokenizer.encode_special(f"<|{name}|>")
    plain = question.answer.replace(",", "")
    text = lambda s: (tokenizer.encode(s), [1] * len(tokenizer.encode(s)), 0)
    rule = question.line % 4
    if rule == 3:
        return {0: text(f"So the answer is\n#### {plain}"), 1: text(f"So\n#### {int(plain) + 1}")}
    if rule == 0:
        call = [special("python_start"), *tokenizer.encode(f"{plain}+0"), special("python_end")]
        output = [special("output_start"), *tokenizer.encode(plain), special("output_end")]  # forced: mask 0
        tail = tokenizer.encode(f"\n#### {question.answer}")
        tokens = tokenizer.encode("Compute ") + call + output + tail
        masks = [1] * (len(tokens) - len(output) - len(tail)) + [0] * len(output) + [1] * len(tail)
        return {1: (tokens, masks, 1)}
    if rule == 1:
        return {1: text(f"#### {question.answer}")}
    return {}


def install(monkeypatch=None):
    """Wrap chat_rl's Engine.generate_many (with `monkeypatch` when given, else for good). Returns the list
    each call appends to: (questions, completions per question) of one generate_many call."""
    from nanochat.engine.engine import Engine
    from nanochat.engine.rows import Completion
    questions = fixture_questions()
    real = Engine.generate_many
    calls = []

    def generate_many(self, prompts, num_samples=1, max_tokens=None, **kwargs):
        results = real(self, prompts, num_samples=num_samples, max_tokens=max_tokens, **kwargs)
        asked = [question_of(self.tokenizer, p, questions) for p in prompts]
        for q, completions in zip(asked, results):
            for sample, (tokens, masks, calls_made) in scripted_rows(self.tokenizer, q).items():
                assert len(tokens) <= max_tokens, f"scripted row of {len(tokens)} tokens > max_tokens={max_tokens}"
                completions[sample] = Completion(tokens=tokens, masks=masks, ended=True, tool_calls=calls_made,
                                                 tool_successes=calls_made)
        calls.append((asked, results))
        return results

    if monkeypatch is None:
        Engine.generate_many = generate_many
    else:
        monkeypatch.setattr(Engine, "generate_many", generate_many)
    return calls


if __name__ == "__main__":
    from nanochat.cli import run_main
    from scripts import chat_rl
    install()
    run_main(chat_rl.main, sys.argv[1:])
