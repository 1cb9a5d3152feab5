"""The sampler's log-probabilities and the sampler-trainer gap (issue: numbers you can trust on the fast path).

The engine records, for every sampled token, its log-probability under the model (temperature 1, whole
vocabulary) and under the distribution it was drawn from; the policy-gradient pass compares the first with
its own log-probability of the same token. Checked here: the recorded values against plain formulas; a gap at
fp32 rounding when both sides compute in fp32 (every nanochat generation); exactly 0 through calculator calls
and early ends for a model whose two paths are the same arithmetic; a measured, bounded gap for bf16 decoding;
a decode broken on purpose (positions shifted) shows a gap orders of magnitude larger; and the rollout
corrections against hand-computed objectives."""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import FP32_GAP_BOUND, BigramModel, TableModel, install_generation, prompt_of

from nanochat.checkpoints.loading import build_model
from nanochat.engine.decode_batch import DecodeBatch
from nanochat.engine.engine import Engine
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.engine.spec import rollout_spec
from nanochat.model.sampling import row_seeds, sample_with_logprobs
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.metrics import objective_metrics
from nanochat.rl.objective import PolicyLoss
from nanochat.rl.policy_gradient import accumulate_policy_gradient

GENERATIONS = ["oct2025", "jan2026", "ve", "ve_late", "mar9", "smear"]
NOTHING = torch.autocast("cpu", enabled=False)


def test_sampled_log_probabilities_follow_their_definitions():
    """Under the model: log-softmax at T=1 over the whole vocabulary. Under the sampled distribution: softmax of
    the top-k logits divided by T (0 for greedy)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    seeds, steps = row_seeds(7, range(6)), torch.arange(6)
    for temperature, top_k in [(1.0, None), (0.7, 5), (1.3, 50), (0.0, None)]:
        tokens, model_lp, sampled_lp = sample_with_logprobs(logits, seeds, steps, temperature, top_k)
        for b in range(6):
            t = int(tokens[b])
            assert model_lp[b].item() == pytest.approx(logits[b, t].item() - torch.logsumexp(logits[b], 0).item(), abs=1e-5)
            if temperature == 0:
                assert t == int(logits[b].argmax()) and sampled_lp[b].item() == 0.0
                continue
            support = logits[b].topk(top_k).values if top_k else logits[b]
            assert logits[b, t] >= support.min()  # drawn from the top-k
            expected = logits[b, t].item() / temperature - torch.logsumexp(support / temperature, 0).item()
            assert sampled_lp[b].item() == pytest.approx(expected, abs=1e-5)


def gap_of(model, tokenizer, prompts, autocast=NOTHING, decode="eager", **kwargs):
    """Roll out with the engine, then run the policy-gradient pass (fp32) on every row (advantages forced to
    +-1) and return (its TrainStats, the completions)."""
    with autocast:
        results = Engine(model, tokenizer, rollout_spec(model, decode=decode)).generate_many(prompts, **kwargs)
    pad = tokenizer.encode_special("<|assistant_end|>")
    batches = []
    for prompt, completions in zip(prompts, results):
        rewards = [float(i % 2) for i in range(len(completions))]  # every row has a non-zero advantage
        batches.append(make_question_batch(prompt, [(c.tokens, c.masks) for c in completions], rewards, pad,
                                           sampler_logprobs=[c.logprobs for c in completions]))
    stats = accumulate_policy_gradient(model, batches, kwargs["num_samples"], len(batches), torch.device("cpu"), NOTHING)
    model.zero_grad(set_to_none=True)
    return stats, [c for per in results for c in per]


@pytest.fixture
def generation_model(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    return lambda name: build_model(str(install_generation(tmp_path, name)), 5, "cpu", "eval")[:2]


SAMPLING = dict(num_samples=4, max_tokens=24, temperature=1.0, top_k=50, seeds=[3, 4, 5])
QUESTIONS = ("What is 12 times 7?", "Tom has 3 apples and buys 5 more.", "Hi")


@pytest.mark.parametrize("name", GENERATIONS)
def test_fp32_gap_is_rounding_for_every_generation(name, generation_model):
    """fp32 decoding (KV cache, shared prompts, one token at a time) against the fp32 training forward (whole
    sequences, prompt computed once): every sampled token's log-probabilities agree to a few ulps
    (helpers.FP32_GAP_BOUND says what is measured and why the bound is 7.6e-6)."""
    model, tokenizer = generation_model(name)
    stats, completions = gap_of(model, tokenizer, [prompt_of(tokenizer, q) for q in QUESTIONS], **SAMPLING)
    assert stats.sampler_tokens == sum(sum(c.masks) for c in completions) > 50
    assert stats.sampler_gap_max <= FP32_GAP_BOUND and 0 <= stats.sampler_k3 <= FP32_GAP_BOUND ** 2 / 2, stats  # k3 ~ d^2/2
    assert len({len(c.tokens) for c in completions}) > 1  # rows of different lengths


def test_a_decode_broken_on_purpose_shows_a_gap_orders_of_magnitude_larger(generation_model, monkeypatch):
    """The metric catches what it is for. Measured on the fixtures (all six generations): clean fp32 max gap
    5e-7..1e-6; odd slots fed the previous step's input (a graph replayed with stale inputs) 2.9..4.2; odd
    slots' rotary positions 16 ahead (a wrong position) 0.02..0.04."""
    model, tokenizer = generation_model("smear")
    prompts = [prompt_of(tokenizer, q) for q in QUESTIONS]
    clean, _ = gap_of(model, tokenizer, prompts, **SAMPLING)
    right_step = DecodeBatch.run_step

    def stale_inputs(self, rows, keys):
        previous = getattr(self, "previous_input", self.host_inputs[1].clone())  # the inputs the host sends
        self.previous_input = self.host_inputs[1].clone()
        self.host_inputs[1, 1::2] = previous[1::2]
        right_step(self, rows, keys)
    monkeypatch.setattr(DecodeBatch, "run_step", stale_inputs)
    stale, _ = gap_of(model, tokenizer, prompts, **SAMPLING)
    monkeypatch.setattr(DecodeBatch, "run_step", right_step)
    right_positions = SharedPromptKVCache.next_positions
    monkeypatch.setattr(SharedPromptKVCache, "next_positions",
                        lambda self: right_positions(self) + 16 * (torch.arange(self.pos.numel()) % 2))
    shifted, _ = gap_of(model, tokenizer, prompts, **SAMPLING)
    assert clean.sampler_gap_max <= FP32_GAP_BOUND
    assert stale.sampler_gap_max > 1.0 and shifted.sampler_gap_max > 1e-3 + 1000 * clean.sampler_gap_max


def test_bf16_decoding_gap_is_measured_and_bounded(generation_model):
    """bf16 autocast decoding (bf16 KV cache) against fp32 training: the gap is what bf16 rounding gives, finite
    and bounded. Measured on the six generation fixtures: mean 2.1e-3..2.2e-3, max 7.5e-3..9.7e-3, k3 ~4e-6
    (bf16 keeps 8 bits of mantissa: relative error 2**-9 per rounding). Stated bounds, 5-10x above: mean <= 0.01,
    max <= 0.1."""
    model, tokenizer = generation_model("smear")
    prompts = [prompt_of(tokenizer, q) for q in QUESTIONS]
    stats, _ = gap_of(model, tokenizer, prompts, autocast=torch.autocast("cpu", dtype=torch.bfloat16), **SAMPLING)
    assert math.isfinite(stats.sampler_gap_max) and stats.sampler_tokens > 50
    assert 1e-5 < stats.sampler_gap_mean <= 0.01 and stats.sampler_gap_max <= 0.1, stats


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_gap_is_zero_through_calculator_calls_and_early_ends(decode, tiny_tokenizer):
    """Forced calculator output carries no sampler log-probability (nan, masked like its target) and every
    sampled token after it is matched with its own position: the gap is rounding (log-probabilities near -5,
    whose ulp is 5e-7)."""
    model = BigramModel(tiny_tokenizer)
    prompts = [prompt_of(tiny_tokenizer, q) for q in ("a b", "Natalia sold clips", "c")]
    stats, completions = gap_of(model, tiny_tokenizer, prompts, decode=decode, num_samples=6, max_tokens=40,
                                temperature=1.0, top_k=0, seeds=[1, 2, 3])
    assert sum(c.tool_successes for c in completions) >= 3 and len({len(c.tokens) for c in completions}) > 3
    for c in completions:
        assert len(c.logprobs) == len(c.tokens) == len(c.sampling_logprobs)
        assert all(math.isnan(lp) == (m == 0) for lp, m in zip(c.logprobs, c.masks))
        assert all(lp == slp for lp, slp, m in zip(c.logprobs, c.sampling_logprobs, c.masks) if m)  # T=1, no top-k
    assert stats.sampler_tokens == sum(sum(c.masks) for c in completions)
    assert stats.sampler_gap_max <= 4e-6 and stats.sampler_k3 <= 1e-11


def test_rollouts_record_the_models_logprobs_not_the_tempered_samplers(tiny_tokenizer):
    """A rollout's batch (rl/rollout.py's sample_questions, what chat_rl trains on) holds, for each sampled target,
    its log-probability under the model at T=1 over the whole vocabulary, the trainer's side of the gap, not the one
    under the tempered top-k distribution it was drawn from. Sampled at T=0.7, top-k 5 (where the two differ by
    tenths), a helpers.BigramModel's log-softmax of the row's previous token, computed here, is the expected
    value; the gap tests above build their batches themselves, so a rollout passing the other list went unseen."""
    from nanochat.rl.rollout import Sampling, sample_questions
    model = BigramModel(tiny_tokenizer)

    class Questions:  # QUESTIONS as a task
        def __getitem__(self, i):
            return {"messages": [{"role": "user", "content": QUESTIONS[i]}, {"role": "assistant", "content": ""}]}

        def reward(self, conversation, text):
            return float(len(text) % 2)
    rollouts = sample_questions(Engine(model, tiny_tokenizer), Questions(), [0, 1, 2], [3, 4, 5],
                                Sampling(num_samples=4, max_new_tokens=16, temperature=0.7, top_k=5))
    checked = 0
    for rollout in rollouts:
        batch = rollout.batch
        known = batch.targets >= 0  # (R, T)
        with torch.no_grad():
            want = torch.log_softmax(model.table[batch.inputs], -1).gather(-1, batch.targets.clamp(min=0)[..., None])
        got, want = batch.sampler_logprobs[known], want.squeeze(-1)[known]
        assert torch.isnan(batch.sampler_logprobs[~known]).all()
        assert (got - want).abs().max() <= FP32_GAP_BOUND, (got - want).abs().max()
        checked += int(known.sum())
    assert checked > 50


# ----------------------------------------------------------------------------- the corrections

def two_row_batch(model, sampler_shift):
    """One question, 2 rows of 3 sampled tokens after a 2-token prompt, advantages +0.5 / -0.5; the sampler's
    log-probabilities are the model's own plus `sampler_shift` (R, 3)."""
    inputs = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 6, 7, 8]])
    batch = make_question_batch([1, 2], [([3, 4, 5], [1, 1, 1]), ([6, 7, 8], [1, 1, 1])], [1.0, 0.0], pad_token=0)
    assert torch.equal(batch.inputs, inputs[:, :-1])
    with torch.no_grad():
        own = torch.log_softmax(model.table[batch.inputs[:, 1:]], -1).gather(-1, batch.targets[:, 1:, None]).squeeze(-1)
    batch.sampler_logprobs = torch.full(batch.targets.shape, float("nan"))
    batch.sampler_logprobs[:, 1:] = own + sampler_shift
    return batch, own


SHIFT = torch.tensor([[0.0, -1.0, 0.3], [-0.2, 0.1, 0.05]])  # trainer minus sampler = -SHIFT


@pytest.mark.parametrize("correction, cap", [("token-tis", 1.5), ("sequence-mask", 2.0), ("sequence-mask", 3.0)])
def test_corrections_equal_hand_computed_objectives(correction, cap):
    """nanochat's pass normalization (2 rows in one pass of 2, 6 valid tokens, 1 question): the objective is
    sum_t A_r * logp_t * c_t / 6 with c_t = min(exp(logp_t - s_t), cap) (token-tis), or 1 for a row whose
    exp(sum_t (logp_t - s_t)) lies in [1/cap, cap] and 0 otherwise (sequence-mask)."""
    torch.manual_seed(0)
    model = TableModel(vocab=10)
    batch, own = two_row_batch(model, SHIFT)
    advantages = torch.tensor([0.5, -0.5])
    log_ratio = -SHIFT  # (2, 3)
    if correction == "token-tis":
        weights = torch.exp(log_ratio).clamp(max=cap)
        changed = int((log_ratio > math.log(cap)).sum())
    else:
        kept = (log_ratio.sum(1).abs() <= math.log(cap)).float()  # row sums: -(-0.7) = 0.7 and -(-0.05) = 0.05
        weights = kept[:, None].expand(2, 3)
        changed = int(3 * (1 - kept).sum())
    expected = float((advantages[:, None] * own * weights).sum() / 6)
    stats = accumulate_policy_gradient(model, [batch], 2, 1, torch.device("cpu"), NOTHING,
                                       loss=PolicyLoss(rollout_correction=correction, correction_cap=cap))
    assert stats.objective == pytest.approx(expected, rel=1e-6)
    assert stats.corrected_fraction == pytest.approx(changed / 6)
    assert stats.sampler_gap_max == pytest.approx(1.0) and stats.sampler_gap_mean == pytest.approx(1.65 / 6)
    k3 = float((torch.exp(log_ratio) - log_ratio - 1).mean())
    assert stats.sampler_k3 == pytest.approx(k3, rel=1e-6)
    if correction == "sequence-mask":
        assert changed == (3 if cap == 2.0 else 0)  # row 0's ratio exp(0.7) = 2.01 leaves [1/2, 2], not [1/3, 3]


def test_no_correction_leaves_objective_and_gradient_bit_identical():
    """--rollout-correction=none (nanochat's): recording the sampler's log-probabilities changes nothing of the
    objective or the gradient, bit for bit."""
    torch.manual_seed(0)
    model = TableModel(vocab=10)
    batch, _ = two_row_batch(model, SHIFT)
    results = []
    for sampler in (batch.sampler_logprobs, None):
        batch.sampler_logprobs = sampler
        model.zero_grad(set_to_none=True)
        stats = accumulate_policy_gradient(model, [batch], 2, 1, torch.device("cpu"), NOTHING)
        results.append((stats.objective, model.table.grad.clone()))
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])


def test_gap_metrics_reach_the_step_metrics():
    first = SimpleNamespace(objective=-0.5, tokens=6, entropy=0.7, rows_trained=2, sampler_tokens=6, sampler_gap_mean=0.1, sampler_gap_max=0.3,
                            sampler_k3=0.01, corrected_fraction=0.5, kl_ref=None)
    m = objective_metrics(first, SimpleNamespace(clip_fraction=None))
    assert (m["sampler_tokens"], m["sampler_gap_mean"], m["sampler_gap_max"], m["sampler_k3"], m["corrected_fraction"]) == \
        (6.0, 0.1, 0.3, 0.01, 0.5)
