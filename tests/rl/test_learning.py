"""RL learns: from a 2-layer model SFT'd on one-step arithmetic until it has partial credit (the `one_step_sft`
fixture), 100 steps of chat_rl raise sampled pass@1 on 256 held-out questions by at least 0.10 absolute.

The starting point is set by accuracy, not by a step count: the fixture's SFT stops at the first check whose
sampled pass@1 on 64 held-out *train* questions is in [0.25, 0.5] (chat_sft --stop-at-pass1), so the model has
partial credit on any machine (a fixed 140 steps gave 0.38 on one CPU and 0.77 on an Intel AVX512 one, issue 28).
The test questions are other questions, so the precondition below allows a margin around that band.

Why the margin is not noise. Both models are scored on the same 256 test questions with the same sampling seeds,
8 samples per question at T=1, so the test looks at the paired per-question differences d_i = p_i(after) -
p_i(before) of the fraction of correct samples. Their mean is the gain; their standard error is std(d) / 16.
The test asserts the gain is both >= 0.10 and >= 3 standard errors (a noise-only gain that large has a chance
of about 1 in 700). Measured on the 2-core development machine (AMD EPYC, AVX2): SFT stopped at step 80 with
held-out pass@1 0.344, then 0.358 -> 0.608 on the test questions (+0.250, SE 0.015). Run with the advantage's
sign flipped (rewarding the wrong answers), the same 100 steps drive pass@1 from 0.358 to 0.004 instead, and
the test fails; that was checked by hand.

Everything runs in fp32 (--dtype=float32), so the trajectory does not depend on whether this CPU has native bf16.
Runtime: SFT ~18 s (80 steps and 16 checks), RL and the two evals ~90 s, on one thread of the 2-core machine."""

import contextlib
import io
import math

import pytest
import torch
from rl_toy_task import OneStepArithmetic

from nanochat.checkpoints.loading import load_model
from nanochat.cli import run_main
from nanochat.engine.engine import Engine
from nanochat.rl.evaluation import sample_outcomes
from scripts import chat_rl

TASK = "rl_toy_task:OneStepArithmetic"
EVAL_QUESTIONS, EVAL_SAMPLES, MAX_NEW_TOKENS = 256, 8, 64
RL_STEPS = 100
MIN_GAIN = 0.10


def per_question_pass_rates(source, base):
    """Fraction of EVAL_SAMPLES correct samples (T=1, top-k 50, fp32 like every stage of this test) per test question."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        model, tokenizer, _ = load_model(source, torch.device("cpu"), phase="eval")
    task = OneStepArithmetic(split="test")
    outcomes = sample_outcomes(Engine(model, tokenizer), task, list(range(EVAL_QUESTIONS)), EVAL_SAMPLES,
                               MAX_NEW_TOKENS, temperature=1.0, top_k=50, seed=0)
    return [sum(o.rewards) / EVAL_SAMPLES for o in outcomes]


@pytest.mark.slow
def test_rl_raises_held_out_pass_at_1_beyond_noise(one_step_sft, monkeypatch):
    base = one_step_sft
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = per_question_pass_rates("sft", base)
        # holds by construction (SFT stopped in [0.25, 0.5] on other questions); kept as the test's premise
        assert 0.15 <= sum(before) / len(before) <= 0.6, "the SFT model must have partial credit for this test to mean anything"
        with contextlib.redirect_stdout(io.StringIO()):
            run_main(chat_rl.main, [f"--task={TASK}", "--device-type=cpu", "--dtype=float32", "--examples-per-step=16", "--num-samples=8",
                                    "--device-batch-size=8", f"--max-new-tokens={MAX_NEW_TOKENS}",
                                    f"--num-steps={RL_STEPS}", "--eval-every=-1", "--save-every=-1",
                                    # eager, as it ran: under the session's pretend CUDA (conftest) auto's compiler
                                    # probe failed and warned that compiling does not work here; compiled training
                                    # is tested in tests/compiling/test_compile.py
                                    "--compile=off"])
        after = per_question_pass_rates("rl", base)
    finally:
        torch.set_num_threads(threads)
    diffs = [a - b for a, b in zip(after, before)]
    gain = sum(diffs) / len(diffs)
    std = math.sqrt(sum((d - gain) ** 2 for d in diffs) / (len(diffs) - 1))
    standard_error = std / math.sqrt(len(diffs))
    summary = f"pass@1 {sum(before) / len(before):.3f} -> {sum(after) / len(after):.3f}, gain {gain:+.3f} (SE {standard_error:.3f})"
    print(summary)  # shown with pytest -s
    assert gain >= MIN_GAIN, summary
    assert gain >= 3 * standard_error, summary
