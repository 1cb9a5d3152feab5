"""The Triton decode step against the hand-written torch step over whole fp32 rollouts, on both targets (in Triton's
interpreter here, compiled on a GPU there: kernel_targets.py).

On a GPU the kernels' fp32 differs from torch's in the last bits (FMA contraction, approximate exp and division), so
"token for token" holds only up to a near-tie. A near-tie: at a row's first differing greedy token, the fp32 logits
of the two choices (read from the model's full forward of the prompt and the tokens both chose before, greedy_agreement)
within FP32_NEAR_TIE of each other (helpers.py derives it from FP32_GAP_BOUND, the sampler-trainer gap: two fp32 paths'
logits agree within it, so two choices closer than it can fall either way). Before the first difference each token's
log-probability within FP32_GAP_BOUND of the torch step's."""

import pytest
import torch
from greedy_agreement import greedy_agreement
from helpers import FP32_GAP_BOUND, FP32_NEAR_TIE, install_generation, prompt_of

pytest.importorskip("triton", reason="the kernels' tests need triton (tests/run.sh installs it)")
from kernel_targets import target  # noqa: E402,F401 (a fixture)

from nanochat.checkpoints.loading import build_model  # noqa: E402
from nanochat.engine.engine import Engine  # noqa: E402
from nanochat.engine.spec import rollout_spec  # noqa: E402

QUESTIONS = ("What is 12 times 7?", "Tom has 3 apples and buys 5 more. How many?", "Hi", "Name a prime over 50.")


def first_difference(a, b):
    """How many tokens two rows share before they differ."""
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same


@pytest.mark.parametrize("name", ["smear"])  # windows, smear, backout, value embeddings: every kernel's branch
def test_greedy_fp32_rollouts_agree_with_the_torch_step_up_to_near_ties(target, name, tmp_path, monkeypatch):
    """Greedy fp32 rollouts of a fixture checkpoint (2 rows a prompt in 3 rows at once: rows admitted into freed
    ones; 2 prompts of 6 tokens in the interpreter, 4 of 48 compiled), the Triton step against the torch step: every
    row equal up to its first difference, each difference a near-tie (the module docstring), the log-probabilities
    before it within FP32_GAP_BOUND."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    model, tokenizer, _ = build_model(str(install_generation(tmp_path, name)), 5, target.device, "eval")
    prompts = [prompt_of(tokenizer, q) for q in (QUESTIONS[:2] if target.interpreted else QUESTIONS)]
    kwargs = dict(num_samples=2, max_tokens=6 if target.interpreted else 48, temperature=0.0, max_rows=3)
    torch_step = Engine(model, tokenizer, rollout_spec(model, decode="static", dtype="float32"))
    torch_step = torch_step.generate_many(prompts, **kwargs)
    triton_step = Engine(model, tokenizer, rollout_spec(model, decode="static", dtype="float32",
                         decode_kernels="triton")).generate_many(prompts, **kwargs)
    reference = [c.tokens for per in torch_step for c in per]
    ours = [c.tokens for per in triton_step for c in per]
    ends = [tokenizer.encode_special(t) for t in ("<|assistant_end|>", "<|bos|>")]
    rows_prompts = [p for p in prompts for _ in range(2)]
    agreement = greedy_agreement(model, rows_prompts, reference, ours, ends)
    assert agreement["tokens"] >= 2 * len(prompts) * 4, agreement
    assert all(abs(m) <= FP32_NEAR_TIE for m in agreement["fp32_margins_at_differences"]), agreement
    gaps = [abs(x - y) for per_a, per_b in zip(torch_step, triton_step) for a, b in zip(per_a, per_b)
            for x, y in zip(a.logprobs[:first_difference(a.tokens, b.tokens)], b.logprobs) if x == x]
    assert len(gaps) >= 2 * len(prompts) * 4 and max(gaps) <= FP32_GAP_BOUND, max(gaps)
