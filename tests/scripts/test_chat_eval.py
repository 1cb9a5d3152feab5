"""chat_eval as a new user meets it (issue 74): without --task it evaluates the task the checkpoint's run trained on
and says so in one line; each eval's result is a file of its own, the latest copied to report/chat_eval_<source>.json.
The numbers themselves: tests/rl/test_pass_at_k.py (rl_toy_task.ScriptedEval's pass@k worked out by hand)."""

import json
from dataclasses import asdict

from nanochat.checkpoints.store import save_checkpoint
from nanochat.cli import run_main
from scripts import chat_eval

SCRIPTED = "rl_toy_task:ScriptedEval"  # 6 test questions, greedy pass@1 1/2 (tests/rl/test_pass_at_k.py)
FLAGS = ["--source=rl", "--num-samples=4", "--max-new-tokens=3", "--device-type=cpu", "--dtype=float32"]


def save_rl_checkpoint(base_dir, model, task):
    """`model` saved where --source=rl looks (chatrl_checkpoints/d2, step 0), its meta recording an RL run's --task."""
    save_checkpoint(str(base_dir / "chatrl_checkpoints" / "d2"), 0, model.state_dict(), None,
                    {"model_config": asdict(model.config), "step": 0, "user_config": {"task": task}})


def test_without_task_it_evaluates_the_checkpoints_own_task(sft, base_dir, capsys):
    """Regression (issue 74): chat_eval --source=rl evaluated GSM8K whatever task the RL run trained on (greedy
    pass@1 0.0000 on a model that scored 0.80 on its own). Now the checkpoint's task, said in one line; --task still
    chooses."""
    save_rl_checkpoint(base_dir, sft, SCRIPTED)
    out_file = base_dir / "eval.json"
    run_main(chat_eval.main, FLAGS + [f"--output={out_file}"])
    result = json.loads(out_file.read_text())
    assert (result["task"], result["num_questions"], result["greedy_pass@1"]) == (SCRIPTED, 6, 0.5)
    assert f"task: {SCRIPTED} (the checkpoint's; --task to choose)" in capsys.readouterr().out.splitlines()
    run_main(chat_eval.main, FLAGS + [f"--output={out_file}", "--task=gsm8k", "--num-examples=2"])
    assert json.loads(out_file.read_text())["task"] == "gsm8k" and "task: " not in capsys.readouterr().out


def test_a_checkpoint_without_a_task_is_evaluated_on_gsm8k():
    """An SFT checkpoint's meta records no --task (its mixture is --tasks): GSM8K, said so; a --task given is taken
    as it is, without a line."""
    assert chat_eval.task_flag(None, {"user_config": {"tasks": "arithmetic"}}) == (
        "gsm8k", "task: gsm8k (the checkpoint records none; --task to choose)")
    assert chat_eval.task_flag(None, {}) == ("gsm8k", "task: gsm8k (the checkpoint records none; --task to choose)")
    assert chat_eval.task_flag("arithmetic", {"user_config": {"task": "gsm8k"}}) == ("arithmetic", None)


def test_a_smaller_eval_keeps_the_earlier_evals_result(sft, base_dir, capsys):
    """Regression (issue 74): `chat_eval --source=rl --num-examples=8` overwrote the 400-question
    report/chat_eval_rl.json. Each eval now writes report/chat_eval/rl-<tag>-step<step>-<time>.json (a -2 added in the
    same second) and copies it to report/chat_eval_rl.json, the latest."""
    save_rl_checkpoint(base_dir, sft, SCRIPTED)
    run_main(chat_eval.main, FLAGS)
    run_main(chat_eval.main, FLAGS + ["--num-examples=2"])
    out = capsys.readouterr().out
    kept = sorted((base_dir / "report" / "chat_eval").glob("rl-d2-step0-*.json"), key=lambda p: p.stat().st_mtime_ns)
    assert [json.loads(p.read_text())["num_questions"] for p in kept] == [6, 2]
    latest = base_dir / "report" / "chat_eval_rl.json"
    assert latest.read_text() == kept[1].read_text()
    assert [line for line in out.splitlines() if line.startswith("wrote ")] == [
        f"wrote {path} (the latest also as {latest})" for path in kept]
