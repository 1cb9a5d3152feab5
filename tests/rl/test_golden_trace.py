"""A golden trace: 4 steps of chat_rl (CPU, fp32, fixed seeds) whose per-step reward, loss and grad norm are
committed in tests/fixtures/golden_trace.json. Any change to the numerics of the objective, the model, the
optimizers or the metrics shows up here as a diff.

The rollouts are teacher-forced: the engine's sampler is replaced by completions drawn from the question's
seed alone (tokens, tool-forced positions, where a row ends), so one CPU's fp32 rounding cannot flip a
sampled token and change the trace discontinuously. Everything after sampling is chat_rl's own code:
rewards, advantages, the batches, the policy gradient, Muon + AdamW with the lr schedule, the metrics.

Tolerance: 1e-4 relative (plus 1e-7 absolute). fp32 kernels differ between CPUs (AVX2, AVX512, AMX) by
~1e-6 relative per operation; four steps of training compound that well below 1e-4, while a change to the
algorithm (a denominator, a mask, an lr) moves these numbers by percents.

After a change that is meant to alter the numerics, regenerate the file with
    NANOCHAT_UPDATE_GOLDEN=1 python -m pytest tests/rl/test_golden_trace.py
which rewrites it and then fails (saying so), so an update can never pass as a check; rerun without the
variable, and say why in the commit.
"""

import json
import os
import random

import pytest
from helpers import FIXTURES, TINY_RL_FLAGS

from nanochat.checkpoints.store import load_checkpoint
from nanochat.engine import Engine
from nanochat.engine.rows import Completion
from scripts import chat_rl

GOLDEN = FIXTURES / "golden_trace.json"
STEPS = 4
TRACED = ("reward", "loss", "grad_norm", "entropy", "completion_length", "rows_trained")


def teacher_forced(self, prompts, num_samples=1, max_tokens=None, seeds=None, progress=None, **sampling):
    """Engine.generate_many's contract with completions fixed by each prompt's seed: byte tokens (ids below
    256, never special), every seventh one forced by the 'tool' (mask 0), rows that end or hit the cap."""
    results = []
    for prompt, seed in zip(prompts, seeds):
        rng = random.Random(seed)
        completions = []
        for _ in range(num_samples):
            length = rng.randint(1, max_tokens)
            tokens = [rng.randrange(32, 127) for _ in range(length)]
            masks = [0 if i % 7 == 6 else 1 for i in range(length)]
            completions.append(Completion(tokens=tokens, masks=masks, ended=length < max_tokens))
        results.append(completions)
        if progress is not None:
            progress(num_samples)
    return results


def test_chat_rl_matches_the_golden_trace(sft, base_dir, monkeypatch):
    monkeypatch.setattr(Engine, "generate_many", teacher_forced)
    chat_rl.main(TINY_RL_FLAGS + [f"--num-steps={STEPS}", "--save-every=-1", "--overwrite"])
    directory = base_dir / "chatrl_checkpoints" / "d2"
    _, _, meta = load_checkpoint(str(directory), STEPS - 1, "cpu")
    trace = [{key: record[key] for key in TRACED} for record in meta["history"]]
    assert [record["step"] for record in meta["history"]] == list(range(STEPS))

    check_against_golden(trace)
    # the trace is not flat: the model learns from the forced samples, so a broken update would show
    assert len({round(t["loss"], 6) for t in trace}) > 1 and all(t["grad_norm"] > 0 for t in trace)


def check_against_golden(trace, path=GOLDEN):
    """Compare `trace` with the committed one; with NANOCHAT_UPDATE_GOLDEN=1 write it there instead and fail."""
    if os.environ.get("NANOCHAT_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps({"flags": TINY_RL_FLAGS, "steps": STEPS, "trace": trace}, indent=1) + "\n")
        pytest.fail(f"NANOCHAT_UPDATE_GOLDEN=1: wrote the new golden trace to {path}; nothing was checked. Rerun "
                    f"without the variable, and commit the file saying why the numerics changed", pytrace=False)
    golden = json.loads(path.read_text())
    assert golden["flags"] == TINY_RL_FLAGS and golden["steps"] == STEPS, "the trace was recorded with other settings"
    # the rollouts are fixed, so the rewards and lengths are exact; the training numbers carry fp32 rounding
    assert len(trace) == len(golden["trace"]), f"{len(trace)} steps traced, {len(golden['trace'])} in {path}"
    for step, (got, want) in enumerate(zip(trace, golden["trace"])):
        for key in TRACED:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), f"step {step}: {key}"


def test_update_mode_writes_the_trace_and_fails(tmp_path, monkeypatch):
    """Regression: NANOCHAT_UPDATE_GOLDEN=1 rewrote the file and then compared the run with what it had just
    written, so the test passed whatever the code computed; left set (in a shell, in CI) it checked nothing."""
    golden = json.loads(GOLDEN.read_text())
    trace = [dict(record, loss=record["loss"] + 1.0) for record in golden["trace"]]  # a trace the file does not hold
    path = tmp_path / "golden_trace.json"
    path.write_text(GOLDEN.read_text())
    monkeypatch.delenv("NANOCHAT_UPDATE_GOLDEN", raising=False)  # this test may run in an update session
    with pytest.raises(AssertionError, match="step 0: loss"):
        check_against_golden(trace, path)  # without the variable: compared, and the difference is caught
    monkeypatch.setenv("NANOCHAT_UPDATE_GOLDEN", "1")
    with pytest.raises(pytest.fail.Exception, match="wrote the new golden trace to .*nothing was checked"):
        check_against_golden(trace, path)
    assert json.loads(path.read_text()) == {"flags": TINY_RL_FLAGS, "steps": STEPS, "trace": trace}
    monkeypatch.delenv("NANOCHAT_UPDATE_GOLDEN")
    check_against_golden(trace, path)  # what was written is what the next run compares with
