"""The procedural arithmetic task: deterministic and split-disjoint, self-consistent references whose tool
calls give exactly what the engine's calculator prints, graded difficulty, GSM8K's grading."""

import json
import os
import re
import subprocess
import sys
from statistics import mean

import pytest
from helpers import REPO

from nanochat.engine.calculator import format_result, use_calculator
from nanochat.errors import UserError
from tasks.arithmetic import LEVELS, Arithmetic, number_to_words, split_of_question
from tasks.registry import resolve_task_class

DIFFICULTIES = sorted(LEVELS)
ALLOWED = set("0123456789*+-/.() ")


def question(conv):
    return conv["messages"][0]["content"]


def parts(conv):
    return conv["messages"][1]["content"]


def exprs(conv):
    return [p["text"] for p in parts(conv) if p["type"] == "python"]


def as_completion(conv, answer=None):
    """The reference answer as the decoded text of a model's completion (special tokens inline),
    optionally with a different final answer."""
    out = []
    for p in parts(conv):
        if p["type"] == "python":
            out.append(f"<|python_start|>{p['text']}<|python_end|>")
        elif p["type"] == "python_output":
            out.append(f"<|output_start|>{p['text']}<|output_end|>")
        else:
            out.append(p["text"])
    text = "".join(out)
    return text if answer is None else re.sub(r"#### \S+$", f"#### {answer}", text)


def stated_numbers(text):
    """The numbers 2..99 a question states in digits or in words, and any larger ones in digits."""
    found = {int(n) for n in re.findall(r"\d+", text)}
    # whole words only: "seven" is not stated by "twenty-seven"
    return found | {n for n in range(2, 100) if re.search(rf"(?<![\w-]){number_to_words(n)}(?![\w-])", text)}


def python_value(expr):
    """Plain Python's value for an expression of digits and + - * / ( ), as the engine's eval would give."""
    assert set(expr) <= ALLOWED and "**" not in expr, expr
    return eval(expr, {"__builtins__": {}})


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_same_index_same_example_across_instances(difficulty):
    for split in ("train", "test"):
        a, b = Arithmetic(split=split, difficulty=difficulty), Arithmetic(split=split, difficulty=difficulty)
        for i in (0, 1, 7, 123, 999):
            assert a[i] == b[i]
            assert a[i] == a[i]  # no state carried between calls


@pytest.mark.slow
def test_same_examples_in_processes_with_different_hash_seeds():
    """Regression guard: seeds derived from hash() of a str differ per process (PYTHONHASHSEED), so a run's
    ranks or a resumed run would see different problems."""
    code = ("import json; from tasks.arithmetic import Arithmetic; "
            "print(json.dumps([Arithmetic(split=s, difficulty=d)[i] for s in ('train', 'test') for d in (1, 4) for i in (0, 5)]))")
    outputs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1]
    here = [Arithmetic(split=s, difficulty=d)[i] for s in ("train", "test") for d in (1, 4) for i in (0, 5)]
    assert outputs[0] == json.loads(json.dumps(here))


def test_seed_selects_another_stream():
    default, seeded, seeded_again = Arithmetic(), Arithmetic(seed=1), Arithmetic(seed=1)
    assert [seeded[i] for i in range(20)] == [seeded_again[i] for i in range(20)]
    assert sum(default[i] == seeded[i] for i in range(20)) == 0


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_train_and_test_questions_are_disjoint(difficulty):
    train = {question(Arithmetic(split="train", difficulty=difficulty)[i]) for i in range(500)}
    test = {question(Arithmetic(split="test", difficulty=difficulty)[i]) for i in range(500)}
    assert not train & test
    assert all(split_of_question(q) == "train" for q in train) and all(split_of_question(q) == "test" for q in test)
    assert len(train) >= 490 and len(test) >= 490  # not a handful of questions repeated


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_references_are_self_consistent(difficulty):
    task = Arithmetic(split="test", difficulty=difficulty)
    for i in range(300):
        conv = task[i]
        ps = parts(conv)
        assert conv["messages"][0]["role"] == "user" and conv["messages"][1]["role"] == "assistant"
        # text, then (python, python_output, text) per tool call, as GSM8K's parsed answers
        assert [p["type"] for p in ps] == ["text"] + ["python", "python_output", "text"] * ((len(ps) - 1) // 3)
        values = []
        for expr_part, output_part, text_after in zip(ps[1::3], ps[2::3], ps[3::3]):
            expr, output = expr_part["text"], output_part["text"]
            assert set(expr) <= ALLOWED and "**" not in expr, expr
            value = python_value(expr)
            assert output == str(value)  # what the engine forces after the call
            assert format_result(use_calculator(expr)) == output  # and the project's calculator agrees
            assert value == int(value) and 2 <= value <= 9999
            assert text_after["text"].startswith(f"{int(value)} ")  # the text repeats the value as an integer
            values.append(int(value))
        # every operand is a number of the question, a previous result, a unit (12 a dozen, 7 a week)
        # or a multiplier said in words ("twice"): the model never has to invent a number
        stated = stated_numbers(question(conv))
        for k, expr in enumerate(exprs(conv)):
            for operand in map(int, re.findall(r"\d+", expr)):
                assert operand in stated | set(values[:k]) | {12, 7, 2, 3, 4, 5}, (question(conv), expr)
        final_text = ps[-1]["text"]
        assert final_text.endswith(f"#### {values[-1]}") and final_text.count("####") == 1
        assert task.reward(conv, as_completion(conv)) == 1.0
        assert task.evaluate(conv, as_completion(conv)) == 1
        assert task.reward(conv, as_completion(conv, values[-1] + 1)) == 0.0
        assert task.reward(conv, as_completion(conv, f"{values[-1]}.0")) == 0.0  # strings compare, like GSM8K
        assert task.reward(conv, as_completion(conv).replace("#### ", "")) == 0.0


def test_difficulty_one_uses_the_right_numbers_and_operation():
    """An independent solver for one-step problems: both numbers come from the question and the operation
    from its wording."""
    task = Arithmetic(split="train", difficulty=1)
    ops = set()
    for i in range(200):
        conv = task[i]
        q = question(conv)
        numbers = re.findall(r"\d+", q)
        assert len(numbers) == 2 and not re.search(r"\b(twice|times)\b", q)
        a, b = numbers
        if re.search(r"\b(in each|holds)\b", q):
            op = "*"
        elif re.search(r"\b(more|together)\b", q):
            op = "+"
        else:
            assert re.search(r"\b(fewer|gives|loses|sells|uses)\b", q), q
            op = "-"
        ops.add(op)
        (expr,) = exprs(conv)
        if op == "*" and q.startswith("There are"):  # "There are m apples in each of Mia's n bags"
            a, b = b, a
        assert expr == f"{a}{op}{b}", (q, expr)
    assert ops == {"+", "-", "*"}


def test_gsm8k_answer_parsing():
    conv = Arithmetic(split="train", difficulty=4)[0]
    answer = parts(conv)[-1]["text"].rsplit("#### ", 1)[1]
    task = Arithmetic()
    assert task.reward(conv, f"#### {answer}") == 1.0
    assert task.reward(conv, f"#### 0\n#### {answer}") == 0.0  # the first "####" counts
    assert task.reward(conv, f"{answer}") == 0.0
    big = next(c for c in (Arithmetic(split="train", difficulty=4)[i] for i in range(200))
               if int(parts(c)[-1]["text"].rsplit(" ", 1)[1]) >= 1000)
    big_answer = int(parts(big)[-1]["text"].rsplit(" ", 1)[1])
    assert task.reward(big, f"so #### {big_answer:,}") == 1.0  # commas are stripped


def test_difficulty_grows_the_problem():
    calls, words, worded, distracting = [], [], [], []
    for difficulty in DIFFICULTIES:
        convs = [Arithmetic(split="train", difficulty=difficulty)[i] for i in range(200)]
        calls.append(mean(len(exprs(c)) for c in convs))
        words.append(mean(len(question(c).split()) for c in convs))
        worded.append(mean(bool(re.search(r"\b(two|three|four|five|six|seven|eight|nine|ten|eleven|twelve)\b|teen\b|ty\b|ty-",
                                          question(c))) for c in convs))
        # numbers in the question that no tool call uses
        distracting.append(mean(len(stated_numbers(question(c)) - {int(n) for e in exprs(c) for n in re.findall(r"\d+", e)})
                                for c in convs))
        assert max(len(question(c).split()) for c in convs) <= 65
    assert calls == sorted(calls) and len(set(calls)) == len(calls), calls
    assert words == sorted(words), words
    assert worded[0] == 0 and worded[2] > 0.3 and worded[3] > worded[2], worded
    assert distracting[0] == 0 and 0 < distracting[1] < distracting[2] < distracting[3], distracting
    hardest = [Arithmetic(split="train", difficulty=4)[i] for i in range(200)]
    assert all(re.search(r"\b(dozen|weeks|dollars)\b", question(c)) for c in hardest)  # units at level 4


def test_division_output_is_what_python_prints():
    """A division's tool output is "12.0" (what the engine will force), the text after it and the answer "12"."""
    found = 0
    for i in range(100):
        conv = Arithmetic(split="train", difficulty=3)[i]
        for expr_part, output_part, text_after in zip(parts(conv)[1::3], parts(conv)[2::3], parts(conv)[3::3]):
            if "/" in expr_part["text"]:
                found += 1
                n = python_value(expr_part["text"])
                assert output_part["text"] == f"{int(n)}.0" and text_after["text"].startswith(f"{int(n)} ")
    assert found > 5


def test_len_and_slicing():
    assert len(Arithmetic(split="train")) == 10_000 and len(Arithmetic(split="test")) == 1_000
    full = Arithmetic(split="test", difficulty=3, size=50)
    assert len(full) == 50
    sliced = Arithmetic(split="test", difficulty=3, size=50, start=10, stop=30, step=5)
    assert len(sliced) == 4
    assert [sliced[i] for i in range(4)] == [full[i] for i in (10, 15, 20, 25)]
    with pytest.raises(IndexError):
        sliced[4]
    assert len(Arithmetic(split="test", size=50, start=40, stop=80)) == 10  # stop is clipped to size
    assert Arithmetic().eval_type == "generative"


@pytest.mark.parametrize("kwargs", [dict(split="validation"), dict(difficulty=0), dict(difficulty=5), dict(size=0), dict(size=2.5)])
def test_bad_arguments(kwargs):
    with pytest.raises(UserError):
        Arithmetic(**kwargs)


def test_registered_as_a_task():
    assert resolve_task_class("arithmetic") is Arithmetic
