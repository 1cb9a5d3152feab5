"""Issue 61's chat_rl options, from the flag to what they change: --calculator-format (recorded in the checkpoint,
kept on --resume, followed by chat_eval and chat_cli unless they are told otherwise), --rejected-tokens (the peers'
denominator rule reaches the objective), --rollout-correction=geo-mask|token-mask (token-mask refused with gspo,
as token-tis is). The formulas themselves are checked against the fp64 reference (tests/rl/test_rl_reference.py)
and the number format on the engine (tests/engine/test_engine.py)."""

import json

import pytest
from helpers import TINY_RL_FLAGS

from nanochat.engine import engine as engine_module
from nanochat.engine.calculator import recorded_calculator_format
from nanochat.errors import UserError
from nanochat.rl.config import RLConfig
from nanochat.rl.rollout import longest_prompt
from nanochat.rl.run import policy_loss_of
from nanochat.tokenizer import get_tokenizer
from scripts import chat_eval, chat_rl
from tasks.registry import make_task


def test_the_defaults_are_todays_and_bad_values_are_one_line():
    config = RLConfig()
    assert (config.calculator_format, config.rejected_tokens) == ("str", "counted")
    assert policy_loss_of(config).rejected_in_denominator is True
    peers = RLConfig(rollout_correction="token-mask", rejected_tokens="uncounted")
    assert policy_loss_of(peers).rejected_in_denominator is False and policy_loss_of(peers).rollout_correction == "token-mask"
    with pytest.raises(UserError, match="^--calculator-format must be str or int, got 'float'$"):
        RLConfig(calculator_format="float")
    with pytest.raises(UserError, match="^--rejected-tokens must be counted or uncounted, got 'maybe'$"):
        RLConfig(rejected_tokens="maybe")
    with pytest.raises(UserError, match="--loss=gspo weighs whole sequences and --rollout-correction=token-mask single "
                                        "tokens; use --rollout-correction=sequence-mask or geo-mask"):
        RLConfig(loss="gspo", ppo_epochs=2, rollout_correction="token-mask")
    RLConfig(loss="gspo", ppo_epochs=2, rollout_correction="geo-mask")  # a sequence-level mask is sound with gspo


def engines_made(monkeypatch):
    """The calculator_format of every Engine made from now on."""
    made = []
    real = engine_module.Engine.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self.spec.calculator_format)  # as resolved, from a script's settings or a run's spec
    monkeypatch.setattr(engine_module.Engine, "__init__", recording)
    return made


def test_the_calculator_format_is_recorded_resumed_and_followed_by_chat_eval(sft, base_dir, monkeypatch):
    """A run with --calculator-format=int (and the peers' rule under token-mask) writes it into its checkpoint, its
    rollouts' engine writes ints; --resume keeps it without the flag; chat_eval on the RL checkpoint follows it, and
    its own flag wins."""
    made = engines_made(monkeypatch)
    flags = TINY_RL_FLAGS + ["--save-every=1", "--rollout-correction=token-mask", "--rejected-tokens=uncounted"]
    chat_rl.main(flags + ["--num-steps=3", "--calculator-format=int"])
    run_dir = base_dir / "chatrl_checkpoints" / "d2"
    meta = json.loads((run_dir / "meta_000002.json").read_text())
    assert meta["user_config"]["calculator_format"] == "int" and meta["user_config"]["rejected_tokens"] == "uncounted"
    assert recorded_calculator_format(meta) == "int" and recorded_calculator_format({}) == "str"
    assert made and set(made) == {"int"}
    for f in run_dir.glob("*_000002*"):
        f.unlink()  # resume from the step before, without the flag
    made.clear()
    chat_rl.main(flags + ["--num-steps=3", "--resume"])
    assert set(made) == {"int"}
    for extra, expected in (([], "int"), (["--calculator-format=str"], "str")):
        made.clear()
        chat_eval.main(["--source=rl", "--task=rl_toy_task:ParityTask", "--num-examples=2", "--num-samples=2",
                        "--max-new-tokens=4", "--device-type=cpu", "--dtype=float32", "--compile=off", *extra])
        assert made == [expected]


def test_eval_tasks_are_measured_beside_the_training_task_and_named_everywhere(sft, base_dir, monkeypatch, capsys):
    """--eval-tasks=arithmetic,gsm8k on a run of the toy task: every eval line has a field for each, the wandb record,
    the checkpoint's eval history and the report eval/<task>/pass@k (a row each); the training task's own keys stay
    as they were. A task named twice, or an unknown one, is one line before anything loads."""
    logged = []
    monkeypatch.setattr(chat_rl, "init_wandb", lambda *a, **k: type("Recorder", (), {
        "log": lambda self, record: logged.append(record), "finish": lambda self: None})())
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--eval-every=1", "--eval-examples=2", "--decode=static",
                                  "--eval-tasks=arithmetic,gsm8k"])
    out = capsys.readouterr().out
    # the static batch is sized for the eval tasks' prompts too: made once, not again for an eval's longer prompts
    tokenizer = get_tokenizer()
    longest = longest_prompt(tokenizer, *(make_task(name, split) for name, split in (
        ("rl_toy_task:ParityTask", "train"), ("rl_toy_task:ParityTask", "test"), ("arithmetic", "test"), ("gsm8k", "test"))))
    assert f"rollouts: static batch sized for prompts of up to {longest} tokens" in out
    eval_lines = [line for line in out.splitlines() if "Pass@1:" in line]
    assert len(eval_lines) == 2 and all("| arithmetic pass@1 " in line and "| gsm8k pass@1 " in line for line in eval_lines)
    evals = [r for r in logged if "time/eval" in r]
    assert len(evals) == 2 and all({"pass@1", "eval/arithmetic/pass@1", "eval/gsm8k/pass@2"} <= set(r) for r in evals)
    meta = json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000000.json").read_text())
    assert {"pass@1", "eval/arithmetic/pass@1", "eval/gsm8k/pass@1"} <= set(meta["eval_history"][-1][1])
    report = (base_dir / "report" / "report.md").read_text()
    assert "| eval/arithmetic/pass@1 |" in report and "| eval/gsm8k/pass@1 |" in report
    with pytest.raises(UserError, match="names a task twice"):
        RLConfig(task="arithmetic", eval_tasks="gsm8k,arithmetic")
    with pytest.raises(UserError, match="nosuchtask"):
        RLConfig(eval_tasks="nosuchtask")


def test_chat_eval_evaluates_several_tasks_in_turn(sft, base_dir, tmp_path, capsys):
    """chat_eval --task=A,B: each task's block is printed and its result kept, in order, under "tasks" in the JSON;
    one task writes the file as it always did (its result at the top)."""
    flags = ["--num-examples=2", "--num-samples=2", "--max-new-tokens=4", "--device-type=cpu", "--dtype=float32",
             "--compile=off"]
    both = chat_eval.main(flags + ["--task=rl_toy_task:ParityTask,arithmetic", f"--output={tmp_path / 'both.json'}"])
    out = capsys.readouterr().out
    assert [r["task"] for r in both["tasks"]] == ["rl_toy_task:ParityTask", "arithmetic"]
    assert out.index("rl_toy_task:ParityTask test, 2 questions") < out.index("arithmetic test, 2 questions")
    assert json.loads((tmp_path / "both.json").read_text()) == json.loads(json.dumps(both))
    one = chat_eval.main(flags + ["--task=arithmetic", f"--output={tmp_path / 'one.json'}"])
    assert one["task"] == "arithmetic" and "tasks" not in one
    assert {k: v for k, v in one.items() if k not in ("seconds", "compile_s")} == {
        k: v for k, v in both["tasks"][1].items() if k not in ("seconds", "compile_s")}  # the same evaluation
