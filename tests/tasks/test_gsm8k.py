"""GSM8K: answer parsing into tool-call parts, answer extraction and reward, data order and data location."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO

from nanochat.errors import UserError
from scripts import prepare_gsm8k
from tasks.gsm8k import GSM8K, GSM8KUnavailableError, answer_to_parts, extract_answer, read_jsonl_rows


def rows_of(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def find(task, prefix):
    return next(task[i] for i in range(len(task)) if task[i]["messages"][0]["content"].startswith(prefix))


# ---------------------------------------------------------------- conversations

def test_fixture_example_parses_into_parts_exactly(gsm8k_dir):
    conv = find(GSM8K(split="train", data_dir=gsm8k_dir), "Weng earns")
    assert conv["messages"][0] == {"role": "user", "content": (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?")}
    assert conv["messages"][1] == {"role": "assistant", "content": [
        {"type": "text", "text": "Weng earns 12/60 = $"},
        {"type": "python", "text": "12/60"},
        {"type": "python_output", "text": "0.2"},
        {"type": "text", "text": "0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $"},
        {"type": "python", "text": "0.2*50"},
        {"type": "python_output", "text": "10"},
        {"type": "text", "text": "10.\n#### 10"},
    ]}
    assert len(conv["messages"]) == 2


def test_negative_numbers_split_on_the_last_equals(gsm8k_dir):
    conv = find(GSM8K(split="train", data_dir=gsm8k_dir), "Three days' temperatures")
    parts = conv["messages"][1]["content"]
    assert parts[:3] == [{"type": "text", "text": "-14 + (-8) + 1 = "},
                         {"type": "python", "text": "-14+-8+1"},
                         {"type": "python_output", "text": "-21"}]
    assert parts[-1]["text"].endswith("#### -7")


def test_answer_to_parts_edge_cases():
    assert answer_to_parts("no tools\n#### 3") == [{"type": "text", "text": "no tools\n#### 3"}]
    # no "=" -> empty output; an answer starting with a call gets an empty leading text part (as re.split gives)
    assert answer_to_parts("<<5>>x") == [{"type": "text", "text": ""}, {"type": "python", "text": "5"},
                                         {"type": "python_output", "text": ""}, {"type": "text", "text": "x"}]
    # split on the LAST "="
    assert answer_to_parts("a <<x=1=2>>b")[1:3] == [{"type": "python", "text": "x=1"}, {"type": "python_output", "text": "2"}]


def test_parts_rebuild_every_fixture_answer(gsm8k_dir):
    for split in ("train", "test"):
        for row in rows_of(gsm8k_dir / f"{split}.jsonl"):
            parts = answer_to_parts(row["answer"])
            rebuilt = ""
            for part in parts:
                if part["type"] == "text":
                    rebuilt += part["text"]
                elif part["type"] == "python":
                    rebuilt += "<<" + part["text"]
                else:
                    rebuilt += "=" + part["text"] + ">>"
            assert rebuilt == row["answer"]
            assert [p["type"] for p in parts] == ["text", "python", "python_output"] * ((len(parts) - 1) // 3) + ["text"]


# ---------------------------------------------------------------- answers and rewards

@pytest.mark.parametrize("text, expected", [
    ("so 1,080.\n#### 1,080", "1080"),
    ("#### 850,000", "850000"),
    ("It was -3 degrees.\n#### -3", "-3"),
    ("#### 0.5 dollars", "0.5"),
    ("#### 18.0", "18.0"),
    ("#### 12\nor maybe #### 13", "12"),  # the first match wins
    ("the answer is 42", None),
    ("####42", None),  # the space is required
    ("#### abc", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_evaluate_and_reward_compare_strings_exactly(gsm8k_dir):
    task = GSM8K(split="test", data_dir=gsm8k_dir)
    conv = find(task, "Janet’s ducks")  # reference "#### 18"
    cases = [("She makes 9 * 2 = 18 dollars.\n#### 18", 1), ("#### 18.0", 0), ("#### 1,8", 1), ("#### 17", 0),
             ("18", 0), ("", 0), ("#### 18\n#### 17", 1), ("#### 17\n#### 18", 0)]
    for response, correct in cases:
        assert task.evaluate(conv, response) == correct, response
        assert task.reward(conv, response) == float(correct)
        assert type(task.reward(conv, response)) is float


def test_evaluate_with_commas_and_negatives(gsm8k_dir):
    task = GSM8K(split="test", data_dir=gsm8k_dir)
    comma = find(task, "Johnny is picking up")  # reference "#### 2,125"
    assert task.evaluate(comma, "#### 2125") == 1 and task.evaluate(comma, "#### 2,125") == 1
    negative = next(task[i] for i in range(len(task)) if task[i]["messages"][1]["content"][-1]["text"].endswith("#### -3"))
    assert task.evaluate(negative, "#### -3") == 1 and task.evaluate(negative, "#### 3") == 0


# ---------------------------------------------------------------- data order and location

@pytest.mark.parametrize("split", ["train", "test"])
def test_local_order_is_the_hub_shuffle_order(gsm8k_dir, split):
    # datasets is a dependency (CI has it); a GPU machine checked offline (tests/gpu_check.sh suite) may not
    datasets = pytest.importorskip("datasets")
    rows = rows_of(gsm8k_dir / f"{split}.jsonl")
    task = GSM8K(split=split, data_dir=gsm8k_dir)
    questions = [task[i]["messages"][0]["content"] for i in range(len(task))]
    assert questions == datasets.Dataset.from_list(rows).shuffle(seed=42)["question"]
    # Dataset.shuffle(seed) is the permutation of numpy's default_rng(seed): the hub split gets the same one
    perm = np.random.default_rng(42).permutation(len(rows))
    assert questions == [rows[i]["question"] for i in perm]
    assert questions != [r["question"] for r in rows]


def test_a_local_copy_needs_no_datasets_package(gsm8k_dir):
    """A GPU box without `datasets` reads a local GSM8K: the order comes from numpy alone (the test above checks
    it is datasets' order). Run where importing datasets fails."""
    code = ("import sys; sys.modules['datasets'] = None\n"  # any `import datasets` now raises ImportError
            "from tasks.gsm8k import GSM8K\n"
            f"task = GSM8K(split='test', data_dir={str(gsm8k_dir)!r})\n"
            "print(task[0]['messages'][0]['content'][:40])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = rows_of(gsm8k_dir / "test.jsonl")
    assert out.stdout.strip() == rows[int(np.random.default_rng(42).permutation(len(rows))[0])]["question"][:40]


def test_env_dir_and_base_dir_are_found(base_dir, gsm8k_dir, monkeypatch, capsys):
    assert (len(GSM8K(split="train")), len(GSM8K(split="test"))) == (12, 8)  # via $NANOCHAT_GSM8K_DIR
    monkeypatch.delenv("NANOCHAT_GSM8K_DIR")
    prepare_gsm8k.main(["--from", str(gsm8k_dir)])
    out = capsys.readouterr().out
    dest = base_dir / "data" / "gsm8k"
    assert f"train: 12 examples -> {dest / 'train.jsonl'}" in out and "hub has 7473" in out
    assert (dest / "train.jsonl").read_bytes() == (gsm8k_dir / "train.jsonl").read_bytes()
    task = GSM8K(split="test")  # via $NANOCHAT_BASE_DIR/data/gsm8k
    reference = GSM8K(split="test", data_dir=gsm8k_dir)
    assert [task[i] for i in range(8)] == [reference[i] for i in range(8)]


def test_prepare_reads_the_speedrun_variable_and_names_it_without_the_hub(base_dir, gsm8k_dir, monkeypatch, capsys):
    """prepare_gsm8k copies from $NANOCHAT_GSM8K_DIR when --from is not given (speedrun.sh calls it so); without
    either and without the hub, its one line names the variable a speedrun user sets, beside --from."""
    prepare_gsm8k.main([])  # conftest's gsm8k_dir is $NANOCHAT_GSM8K_DIR
    dest = base_dir / "data" / "gsm8k"
    assert (dest / "test.jsonl").read_bytes() == (gsm8k_dir / "test.jsonl").read_bytes()
    assert f"test: 8 examples -> {dest / 'test.jsonl'}" in capsys.readouterr().out
    monkeypatch.delenv("NANOCHAT_GSM8K_DIR")
    monkeypatch.setattr(prepare_gsm8k, "hub_offline", lambda: False)
    monkeypatch.setattr(prepare_gsm8k, "hub_reachable", lambda: False)
    with pytest.raises(UserError) as e:
        prepare_gsm8k.main(["--output-dir", str(base_dir / "elsewhere")])
    assert str(e.value) == ("cannot reach the Hugging Face hub to download openai/gsm8k; point NANOCHAT_GSM8K_DIR (or "
                            "--from) at a directory holding GSM8K's train.jsonl and test.jsonl, copied from a machine "
                            "with the hub (e.g. NANOCHAT_GSM8K_DIR=DIR bash speedrun.sh)")
    assert not (base_dir / "elsewhere").exists()


def test_no_data_offline_is_a_helpful_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOCHAT_GSM8K_DIR", raising=False)
    with pytest.raises(GSM8KUnavailableError) as e:
        GSM8K(split="train")
    message = str(e.value)
    assert (e.value.subset, e.value.split) == ("main", "train")
    assert "NANOCHAT_GSM8K_DIR" in message and "scripts." not in message  # prepare_gsm8k: nanochat.cli's hint
    assert "\n" not in message


def test_explicit_dir_without_the_split_or_subset(tmp_path, gsm8k_dir, monkeypatch):
    with pytest.raises(UserError, match="test.jsonl does not exist"):
        GSM8K(split="test", data_dir=tmp_path)
    monkeypatch.setenv("NANOCHAT_GSM8K_DIR", str(tmp_path))
    with pytest.raises(UserError, match="NANOCHAT_GSM8K_DIR"):
        GSM8K(split="train")
    with pytest.raises(UserError, match="socratic"):
        GSM8K(subset="socratic", split="train", data_dir=gsm8k_dir)
    with pytest.raises(UserError, match="unknown GSM8K split 'validation'"):
        GSM8K(split="validation", data_dir=gsm8k_dir)


def test_malformed_jsonl_names_the_line(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n{"question": "q"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"train.jsonl:2 lacks"):
        read_jsonl_rows(tmp_path / "train.jsonl")
    (tmp_path / "test.jsonl").write_text("not json\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"test.jsonl:1 is not valid JSON"):
        GSM8K(split="test", data_dir=tmp_path)
    with pytest.raises(UserError, match="lacks"):  # prepare validates before copying anything
        prepare_gsm8k.main(["--from", str(tmp_path), "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_slicing_through_the_task_base(gsm8k_dir):
    full = GSM8K(split="train", data_dir=gsm8k_dir)
    sliced = GSM8K(split="train", data_dir=gsm8k_dir, start=1, stop=9, step=3)
    assert (full.num_examples(), len(full), len(sliced)) == (12, 12, 3)
    assert [sliced[i] for i in range(3)] == [full[1], full[4], full[7]]
    with pytest.raises(IndexError):
        sliced[3]
    assert len(GSM8K(split="train", data_dir=gsm8k_dir, start=10, step=5)) == 1
    assert full.eval_type == "generative"
