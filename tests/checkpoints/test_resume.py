"""Resume, preemption, overwrite protection, non-finite steps and out-of-memory retries in chat_rl."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import PYTHONPATH, REPO, TINY_RL_FLAGS, assert_same_weights, weights

from nanochat.cli import run_main
from nanochat.engine import Engine
from nanochat.engine.memory import RolloutMemory
from nanochat.errors import UserError
from nanochat.rl import run as rl_run
from nanochat.rl.policy_gradient import TrainStats
from nanochat.rl.progress import RolloutLog
from scripts import chat_rl


def rl_dir(base_dir):
    return base_dir / "chatrl_checkpoints" / "d2"


def digests(root):
    """Every file under root: its bytes' digest."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def test_resumed_run_ends_with_the_same_weights(sft, base_dir):
    """Stopped after step 2 and resumed, a CPU fp32 run is bitwise equal to the uninterrupted run: the
    model and optimizer states are saved exactly, the data position and the sampling seeds are functions of
    the step, and the run's flags are restored from the checkpoint."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=4", "--save-every=2"])
    uninterrupted = weights(rl_dir(base_dir) / "model_000003.pt")
    os.remove(rl_dir(base_dir) / "model_000003.pt")
    chat_rl.main(["--resume=d2:2", "--device-type=cpu", "--num-steps=3"])  # --num-steps is restored from the run
    assert_same_weights(weights(rl_dir(base_dir) / "model_000003.pt"), uninterrupted)


def test_existing_run_is_refused_before_loading_with_the_flags_that_work(sft, base_dir, capsys):
    """Regression (issue 74): the refusal came after the model had loaded and the run had timed itself, named
    --model-tag (which chooses the model to load) as a way out, and did not say what --overwrite deletes."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=3", "--save-every=1"])
    before = sorted(os.listdir(rl_dir(base_dir)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS + ["--num-steps=1"])
    out, err = capsys.readouterr()
    files = "meta_000001.json, model_000001.pt, optim_000001_rank0.pt, meta_000002.json, model_000002.pt, " \
            "optim_000002_rank0.pt"
    assert e.value.code == 2 and err == (
        f"error: {rl_dir(base_dir)} already holds an RL run, steps 1-2: 6 files ({files}); continue it with --resume, "
        f"write the new run beside it with --output-tag=<new name>, or delete those files for good and start over "
        f"with --overwrite\n")
    assert out == ""  # before anything loads
    assert sorted(os.listdir(rl_dir(base_dir))) == before
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--overwrite"])
    assert f"--overwrite: deleted the RL run that was in {rl_dir(base_dir)}, steps 1-2: 6 files ({files})\n" in \
        capsys.readouterr().out
    # the old run's later steps are gone, so "the last step" is the new run's
    assert sorted(p.name for p in rl_dir(base_dir).glob("model_*.pt")) == ["model_000000.pt"]


def test_a_finished_run_says_so_and_how_to_go_on_without_evaluating_it_again(sft, base_dir, capsys):
    """Regression (issue 74): --resume of a finished run re-ran its final eval, rewrote its report and exited 0
    without a word that the run was finished or of how to train it further."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--eval-every=2", "--eval-examples=2"])
    before = digests(base_dir)
    final = json.loads((rl_dir(base_dir) / "meta_000001.json").read_text())["eval_history"][-1]
    capsys.readouterr()
    assert final[0] == 2
    assert run_main(chat_rl.main, ["--resume", "--device-type=cpu"]) is None  # exit 0
    task = "--task=rl_toy_task:ParityTask"
    assert capsys.readouterr().out.splitlines()[1:] == [
        f"Run d2 is finished: all 2 of its steps are trained, the last (step 1) saved and its final eval recorded "
        f"(pass@1 {final[1]['pass@1']:.4f}). Nothing to do.",
        f"  evaluate it:      python -m scripts.chat_eval --source=rl --model-tag=d2 {task}",
        f"  train it further: python -m scripts.chat_rl --source=rl --model-tag=d2 --device-type=cpu --dtype=float32 "
        f"--rollout-dtype=float32 {task} --device-batch-size=2 --examples-per-step=4 --num-samples=4 "
        f"--max-new-tokens=12 --eval-every=2 --eval-examples=2 --save-every=-1 --num-steps=N (a new run, written to "
        f"d2_cont)"]
    assert digests(base_dir) == before  # no eval run again: its meta and the report as they were


def test_resume_names_each_flag_it_replaced_and_refuses_a_longer_run(sft, base_dir, capsys):
    """Regression (issue 74): the flags given with --resume that the run's saved settings replaced went unsaid (one
    line listed every restored setting, given or not), and --num-steps beyond the run's was silently dropped."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=3", "--save-every=1"])
    os.remove(rl_dir(base_dir) / "model_000002.pt")  # the run is continued from step 1
    before = digests(base_dir)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, ["--resume", "--device-type=cpu", "--num-steps=4"])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and err.startswith("error: --num-steps=4: run d2 was planned with 3 steps, over which its "
                                                "learning rate decays (--lr-schedule=linear), and --resume continues it "
                                                "to that end, not further; ") and err.count("\n") == 1
    assert "python -m scripts.chat_rl --source=rl --model-tag=d2 --device-type=cpu " in err
    assert " --num-steps=4 (a new run, written to d2_cont)\n" in err  # (its flags: the test below)
    assert out == "" and digests(base_dir) == before  # refused before anything loads or changes
    # the saved length or less, other flags given: each replaced one said by name; a runtime flag (--train-rows) and
    # a value the run has (--max-new-tokens=12) are not
    chat_rl.main(["--resume", "--device-type=cpu", "--num-steps=2", "--eval-examples=5", "--advantage-std",
                  "--max-new-tokens=12", "--train-rows=8"])
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if " ignored: " in line] == [
        "--advantage-std ignored: the run's saved advantage_std=False is kept (--resume continues a run with its own "
        "settings)",
        "--eval-examples=5 ignored: the run's saved eval_examples=400 is kept (--resume continues a run with its own "
        "settings)",
        "--num-steps=2 ignored: the run's saved num_steps=3 is kept (--resume continues a run with its own settings)"]
    restored = lines[0]
    assert restored.startswith("--resume: run d2 continues with its saved settings (where they differ from the "
                               "defaults: ") and "max_new_tokens" not in restored and "num_steps" not in restored
    assert "task=rl_toy_task:ParityTask" in restored
    assert any(line.startswith("Step 2/3 ") for line in lines)  # the run's third and last step, as saved


def test_the_command_that_trains_further_carries_the_runs_settings_and_the_flags_given(sft, base_dir, capsys):
    """Regression: the new run that --resume's refusal of a longer run suggests (from the run's last checkpoint) took
    the run's --task alone, so copied it ran on nanochat's defaults, without the flags given with --resume
    (--device-type, --eval-examples): another run, on another device. Copied as printed, it now trains on with each
    of the run's settings (as its meta records them) but the flags given, which are the command line's."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--eval-examples=2", "--top-k=5"])
    saved = json.loads((rl_dir(base_dir) / "meta_000001.json").read_text())["user_config"]
    capsys.readouterr()
    given = ["--resume", "--device-type=cpu", "--num-steps=3", "--eval-examples=3", "--train-rows=2", "--advantage-std"]
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, given)
    err = capsys.readouterr().err
    command = ("python -m scripts.chat_rl --source=rl --model-tag=d2 --device-type=cpu --dtype=float32 "
               "--rollout-dtype=float32 --task=rl_toy_task:ParityTask --device-batch-size=2 --train-rows=2 "
               "--examples-per-step=4 --num-samples=4 --max-new-tokens=12 --top-k=5 --advantage-std --eval-every=-1 "
               "--eval-examples=3 --save-every=-1 --num-steps=3")
    assert e.value.code == 2 and err.endswith(f"start a new run from its last checkpoint: {command} (a new run, "
                                              f"written to d2_cont)\n")
    chat_rl.main(command.split()[3:])
    new = json.loads((base_dir / "chatrl_checkpoints" / "d2_cont" / "meta_000002.json").read_text())["user_config"]
    assert (new["source"], new["model_tag"], new["num_steps"], new["output_tag"]) == ("rl", "d2", 3, "d2_cont")
    changed = {k for k in saved if new[k] != saved[k]} - {"source", "model_tag", "model_step", "num_steps", "output_tag"}
    assert changed == {"eval_examples", "train_rows", "advantage_std"}
    assert (new["eval_examples"], new["train_rows"], new["advantage_std"]) == (3, 2, True)


def test_resume_errors_are_one_line(sft, base_dir, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, ["--resume", "--device-type=cpu"])
    assert e.value.code == 2 and "no RL run in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_main(chat_rl.main, ["--resume", "--overwrite"])
    assert "pass only one" in capsys.readouterr().err


def test_resume_of_a_missing_step_names_the_saved_ones(sft, base_dir, capsys):
    """Regression: --resume=TAG:STEP of a step that was never saved ended with the loader's hint to pick
    another --model-step, a flag that does nothing with --resume."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, ["--resume=d2:7", "--device-type=cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "run 'd2' has no step 7; saved steps: 1 (e.g. --resume=d2:1)" in err
    assert "--model-step" not in err


def test_overwrite_keeps_the_old_run_until_the_new_one_has_loaded(sft, base_dir, monkeypatch, capsys):
    """Regression: --overwrite cleared the old run before the --kl-coef reference model was loaded, so a
    failure there (out of memory for the second copy) lost the old run for nothing."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1"])
    before = sorted(os.listdir(rl_dir(base_dir)))

    def failing_reference(*args, **kwargs):
        raise UserError("simulated: the reference model does not fit")
    monkeypatch.setattr(rl_run, "load_reference", failing_reference)
    with pytest.raises(SystemExit):
        run_main(chat_rl.main, TINY_RL_FLAGS + ["--num-steps=2", "--overwrite", "--kl-coef=0.1"])
    assert "simulated" in capsys.readouterr().err
    assert sorted(os.listdir(rl_dir(base_dir))) == before


def test_non_finite_steps_are_skipped_then_abort(sft, base_dir, monkeypatch, capsys):
    calls = []

    def nan_gradient(model, *args, **kwargs):
        calls.append(1)
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan"))
        return TrainStats(objective=float("nan"), entropy=0.0, rows_trained=0, rows_total=0)

    monkeypatch.setattr(rl_run, "accumulate_policy_gradient", nan_gradient)
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS + ["--num-steps=5", "--max-bad-steps=2"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and len(calls) == 2
    assert captured.out.count("skipping the optimizer step") == 2
    assert "2 consecutive steps had a non-finite loss or gradient" in captured.err
    assert not list(rl_dir(base_dir).glob("model_*.pt"))  # nothing bad was saved


def test_out_of_memory_halves_the_batch_and_gives_the_same_result(sft, base_dir, tmp_path, monkeypatch, capsys):
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1"])
    reference = weights(rl_dir(base_dir) / "model_000001.pt")

    real_rollout, real_accumulate = Engine._completions, rl_run.accumulate_policy_gradient
    raised = {"rollout": 0, "train": 0}

    def rollout(self, *args, **kwargs):  # one attempt of a step's rollouts (Engine.generate_many)
        if not raised["rollout"]:
            raised["rollout"] += 1
            self.last_stats.max_batch_rows = 8
            raise torch.OutOfMemoryError("simulated")
        return real_rollout(self, *args, **kwargs)

    def accumulate(*args, micro_batch_rows=None, **kwargs):
        if micro_batch_rows == 16:  # --train-rows auto: 16 rows, every trained row of the step
            raised["train"] += 1
            raise torch.OutOfMemoryError("simulated")
        return real_accumulate(*args, micro_batch_rows=micro_batch_rows, **kwargs)

    monkeypatch.setattr(Engine, "_completions", rollout)
    monkeypatch.setattr(rl_run, "accumulate_policy_gradient", accumulate)
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--overwrite"])
    out = capsys.readouterr().out
    assert "out of memory during rollouts: retrying with --max-rows=4" in out
    # the first training retry gives back what the engine keeps between rollouts (its fp32 q/k/v concatenations
    # here), the second halves the rows
    assert "gave back the KV cache, decode graphs and weights the rollout engine keeps" in out
    assert "out of memory during training: retrying with 8 rows per forward pass" in out
    assert raised == {"rollout": 1, "train": 2}
    got = weights(rl_dir(base_dir) / "model_000001.pt")
    # Fewer rows per forward sums the same gradient in another order (fp32 ulps). AdamW's first step divides
    # by |g| + 1e-10, so an element whose gradient is ~1e-10 moves by a rounding-dependent fraction of its lr
    # (measured: one wte element of 28672 off by 3e-6, everything else <= 4e-7); a real difference in the
    # objective moves weights by ~lr (1e-2 here).
    for k in got:
        assert torch.allclose(got[k], reference[k], atol=1e-5), k


@pytest.mark.slow
def test_out_of_memory_in_a_rollout_first_gives_back_the_batches_kept_from_other_rollouts(sft, base_dir, monkeypatch,
                                                                                          capsys):
    """The engine keeps the eval's static batch beside the steps' (Engine._new_batch). An out-of-memory in a step's
    rollout first gives the kept batches back and retries with the same rows: nothing halved, the weights those of
    an undisturbed run, bit for bit."""
    flags = TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--decode=static", "--eval-every=1",
                             "--eval-examples=4"]
    chat_rl.main(flags)
    reference = weights(rl_dir(base_dir) / "model_000001.pt")
    real_within_memory, kept_when_raised = RolloutMemory.within_memory, []

    def within_memory(memory, rollout, *args):  # a step's rollouts (the evals' do not back off)
        def failing_once(*attempt):
            if not kept_when_raised:
                kept_when_raised.append(len(memory.kept))
                raise torch.OutOfMemoryError("simulated")
            return rollout(*attempt)
        return real_within_memory(memory, failing_once, *args)

    monkeypatch.setattr(RolloutMemory, "within_memory", within_memory)
    chat_rl.main(flags + ["--overwrite"])
    out = capsys.readouterr().out
    assert kept_when_raised == [1]  # step 0's eval batch
    assert "out of memory during rollouts: gave back the 1 decode batch(es) kept from other rollouts; retrying" in out
    assert "retrying with" not in out
    assert_same_weights(weights(rl_dir(base_dir) / "model_000001.pt"), reference)


@pytest.mark.slow
def test_out_of_memory_in_training_first_gives_back_the_evals_batch_then_the_steps(sft, base_dir, monkeypatch, capsys):
    """With an eval's static batch kept beside the step's, an out-of-memory in training first gives back the eval's
    (the step's batch stays, and the engine keeps batches still), and retries with the same rows: the weights are
    an undisturbed run's, bit for bit."""
    flags = TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--decode=static", "--eval-every=1",
                             "--eval-examples=4"]
    chat_rl.main(flags)
    reference = weights(rl_dir(base_dir) / "model_000001.pt")
    real_accumulate, kept_when_raised = rl_run.accumulate_policy_gradient, []
    engines, real_init = [], Engine.__init__

    def init(self, *args, **kwargs):
        engines.append(self)
        real_init(self, *args, **kwargs)

    def accumulate(*args, **kwargs):
        if not kept_when_raised:
            kept_when_raised.append([k.shape.num_samples for k in engines[-1].memory.kept])
            raise torch.OutOfMemoryError("simulated")
        return real_accumulate(*args, **kwargs)

    monkeypatch.setattr(rl_run, "accumulate_policy_gradient", accumulate)
    monkeypatch.setattr(Engine, "__init__", init)
    chat_rl.main(flags + ["--overwrite"])
    out = capsys.readouterr().out
    assert kept_when_raised == [[2, 4]]  # the eval's (--device-batch-size samples), then the step's (--num-samples)
    assert ("out of memory during training: gave back the 1 decode batch(es) the rollout engine keeps from other "
            "rollouts (an eval's); retrying") in out
    assert "keeps none from now on" not in out and "retrying with" not in out
    assert engines[-1].memory.keeps_between_rollouts
    assert_same_weights(weights(rl_dir(base_dir) / "model_000001.pt"), reference)


def test_out_of_memory_in_training_first_releases_the_kept_rollout_batch(sft, base_dir, monkeypatch, capsys):
    """With a static decode step the engine keeps its batch (KV cache; on CUDA, graphs) between rollouts. An
    out-of-memory in training first gives that memory back and retries with the same rows, so nothing is halved
    and the weights are those of an undisturbed run, bit for bit; from then on the engine keeps nothing between
    rollouts, so the next step's training has that memory too."""
    flags = TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--decode=static"]
    chat_rl.main(flags)
    reference = weights(rl_dir(base_dir) / "model_000001.pt")
    real_accumulate, real_release = rl_run.accumulate_policy_gradient, RolloutMemory.release
    released, kept_at_training = [], []
    engines = []

    def accumulate(*args, **kwargs):
        kept_at_training.append(engines[-1].memory.kept_batch is not None)
        if not released:
            raise torch.OutOfMemoryError("simulated")
        return real_accumulate(*args, **kwargs)

    def release(self, **kwargs):
        released.append(self.kept_batch is not None)
        return real_release(self, **kwargs)

    real_init = Engine.__init__

    def init(self, *args, **kwargs):
        engines.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(rl_run, "accumulate_policy_gradient", accumulate)
    monkeypatch.setattr(RolloutMemory, "release", release)
    monkeypatch.setattr(Engine, "__init__", init)
    chat_rl.main(flags + ["--overwrite"])
    out = capsys.readouterr().out
    assert released == [True] and kept_at_training == [True, False, False]  # step 0: failed, retried; step 1
    assert ("out of memory during training: gave back the KV cache, decode graphs and weights the rollout engine "
            "keeps between rollouts (it keeps none from now on); retrying") in out
    assert "retrying with" not in out
    assert_same_weights(weights(rl_dir(base_dir) / "model_000001.pt"), reference)


@pytest.mark.slow
def test_sigterm_saves_and_resume_matches_uninterrupted_run(sft, base_dir, tmp_path, tiny_tokenizer):
    """A real process: start, SIGTERM once a step has completed, check the saved checkpoint and the
    message, resume to the end, and compare with an uninterrupted run in a copy of the base dir."""
    other = tmp_path / "other"
    shutil.copytree(base_dir, other)
    flags = TINY_RL_FLAGS + ["--num-steps=6", "--save-every=-1"]
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": PYTHONPATH, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "scripts.chat_rl", *flags], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.time() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Step 1/6"):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.time() < deadline
    out, err = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGTERM, err
    saved = [p.name for p in rl_dir(base_dir).glob("model_*.pt")]
    assert len(saved) == 1
    step = int(saved[0][6:12])
    assert step < 5 and f"--resume=d2:{step}" in out
    resumed = subprocess.run([sys.executable, "-m", "scripts.chat_rl", "--resume", "--device-type=cpu"], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    full = subprocess.run([sys.executable, "-m", "scripts.chat_rl", *flags], cwd=REPO,
                          env={**env, "NANOCHAT_BASE_DIR": str(other)}, capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-2000:]
    assert_same_weights(weights(rl_dir(base_dir) / "model_000005.pt"), weights(rl_dir(other) / "model_000005.pt"))


def test_saved_rollouts_are_every_sample_and_a_resume_rewrites_them_exactly(sft, base_dir):
    """--save-rollouts: one JSON line per sample, each step's lines together, the advantage its reward minus the
    question's mean; resumed from step 1 (after a crash cut a line of step 3 short), the run drops the lines of
    later steps and writes them again: the file ends as the uninterrupted run's, byte for byte (CPU fp32 resumes
    bitwise). A new run in the directory (--overwrite) starts the file afresh."""
    import json
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=4", "--save-every=1", "--save-rollouts"])
    path = rl_dir(base_dir) / "rollouts_rank0.jsonl"
    uninterrupted = path.read_bytes()
    lines = [json.loads(line) for line in uninterrupted.decode().splitlines()]
    assert [line["step"] for line in lines] == [s for s in range(4) for _ in range(4 * 4)]  # 4 questions x 4 samples
    for step in range(4):
        for question in {line["question"] for line in lines if line["step"] == step}:
            samples = [line for line in lines if (line["step"], line["question"]) == (step, question)]
            assert [s["sample"] for s in samples] == [0, 1, 2, 3]
            mean = sum(s["reward"] for s in samples) / 4
            assert all(abs(s["advantage"] - (s["reward"] - mean)) < 1e-6 for s in samples)
            assert all(0 < s["length"] <= 12 and isinstance(s["text"], str) for s in samples)
    path.write_bytes(uninterrupted + b'{"step": 3, "quest')  # a crash in the middle of a step's write
    for name in ("model_000002.pt", "model_000003.pt"):
        os.remove(rl_dir(base_dir) / name)
    chat_rl.main(["--resume=d2:1", "--device-type=cpu", "--save-rollouts"])
    assert path.read_bytes() == uninterrupted
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--save-rollouts", "--overwrite"])
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0] * 16


def test_a_write_that_fails_mid_run_is_one_line_naming_the_step_kept(sft, base_dir, monkeypatch, capsys):
    """Regression (issue 74): a file the run could not write once training was under way (here --save-rollouts'
    file, a folder in its place by step 2: a failure that no permission, not even root's, lets through) ended the
    run with a traceback (exit 1) that said nothing of what the run had kept."""
    real_append = RolloutLog.append

    def append(self, step, rollouts):
        if step == 2:
            os.remove(self.path)
            os.mkdir(self.path)
        return real_append(self, step, rollouts)
    monkeypatch.setattr(RolloutLog, "append", append)
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS + ["--num-steps=4", "--save-every=1", "--save-rollouts"])
    path = rl_dir(base_dir) / "rollouts_rank0.jsonl"
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"error: could not write {path}: Is a directory; the checkpoint of step 1 was kept (--resume=d2:1 continues "
        f"from it); check the disk, or write elsewhere\n")
    assert sorted(p.name for p in rl_dir(base_dir).glob("model_*.pt")) == ["model_000001.pt"]
