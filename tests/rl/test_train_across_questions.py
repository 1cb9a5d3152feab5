"""The training pass at fewer, larger kernels: forwards that hold rows of several questions (prompts of different
lengths run as one right-padded batch), the chunked vocabulary-wide head, and the meta-device kernel count.
Whatever the rows per forward, the gradient is the same: checked in fp64 on a generation with smear, value
embeddings, backout and a short window that binds (prompts and rows past 128 tokens)."""

import copy
import math
from contextlib import nullcontext

import pytest
import torch
from helpers import random_model, tiny_config

from nanochat.model import head
from nanochat.model.gpt import GPT
from nanochat.model.head import logprobs_and_entropy, sampled_logprobs_and_entropy, softcapped_logits
from nanochat.rl import policy_gradient
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.objective import PolicyLoss
from nanochat.diagnostics.train_count import count_train_step_ops
from nanochat.rl.policy_gradient import _Tally, accumulate_policy_gradient

PAD = 0
VOCAB = 300  # padded to 320 rows: the head's crop matters


def smear_model():
    """smear: smear, backout (after layer 1 of 3: at the last layer it would cancel in the final norm), value
    embeddings; sequence_len 256 gives windows of 128 (S) and 256 (L)."""
    config = tiny_config(sequence_len=256, vocab_size=VOCAB, n_layer=3, n_head=4, n_kv_head=2, n_embd=32,
                         window_pattern="SL")
    return random_model(config, seed=1, noise=0.2, generation="smear").double()


def questions(sampler=False):
    """Five questions of six samples, prompts of 150, 9, 131, 40 and 1 tokens, completions of 1 to 70 tokens with
    forced (mask 0) tokens; one question with no signal, one with two zero-advantage rows. sampler: each sampled
    token's sampler log-probability, near the trainer's (the rollout correction's input)."""
    gen = torch.Generator().manual_seed(7)
    tokens = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    spec = [(150, [5, 70, 1, 33, 12, 40], [1, 0, 0, 1, 0, 1]),
            (9, [60, 2, 17, 17, 30, 3], [0, 0, 0, 0, 0, 0]),  # no signal
            (131, [8, 9, 10, 11, 12, 13], [1, 0, 0.5, 0.5, 1, 0]),  # rows 2, 3: advantage 0
            (40, [66, 1, 25, 4, 50, 7], [0, 1, 1, 0, 1, 0]),
            (1, [12, 30, 2, 9, 20, 6], [1, 1, 0, 0, 0, 1])]
    batches = []
    for prompt_length, lengths, rewards in spec:
        completions = [(tokens(n), [0 if i % 4 == 3 else 1 for i in range(n)]) for n in lengths]
        logprobs = [(-torch.rand(n, generator=gen) * 3).tolist() for n in lengths] if sampler else None
        batches.append(make_question_batch(tokens(prompt_length), completions, rewards, PAD, sampler_logprobs=logprobs))
    return batches


def gradients(model, batches, **kwargs):
    model.zero_grad(set_to_none=True)
    stats = accumulate_policy_gradient(model, batches, 2, len(batches), "cpu", nullcontext(), **kwargs)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, stats


def assert_same_gradient(got, want, rtol):
    for name in want:
        error = (got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30)
        assert error <= rtol, (name, error.item())


@pytest.fixture(scope="module")
def model():
    return smear_model()


@pytest.mark.parametrize("rows_per_forward, head_chunk", [(7, None), (16, None), (64, None), (64, 7)])
def test_rows_of_several_questions_per_forward_give_the_same_gradient(model, rows_per_forward, head_chunk, monkeypatch):
    """Rows per forward 1 (every row alone), 7 and 16 (forwards cut across questions, 7 splitting questions between
    forwards that hold several) and 64 (every trained row in one
    forward, five prompts of 1 to 150 tokens right-padded together; and with the head in chunks of 7 tokens): the
    same gradient of every parameter (fp64, 1e-10 of its norm), the same objective, and each sampled token's
    log-probability stored at its own question's (row, position). A row attending to another question's prompt or
    its padding, outside its window or at a wrong rotary position moves them by 0.4 to 4 (measured)."""
    batches = questions()
    if head_chunk:
        monkeypatch.setattr(head, "HEAD_CHUNK_TOKENS", head_chunk)
    want, want_stats = gradients(model, batches, micro_batch_rows=1)
    got, stats = gradients(model, batches, micro_batch_rows=rows_per_forward)
    assert stats.rows_trained == want_stats.rows_trained == 22 and stats.tokens == want_stats.tokens
    assert stats.objective == pytest.approx(want_stats.objective, rel=1e-6, abs=1e-9)  # fp32 logits: fp32 sums
    assert_same_gradient(got, want, 1e-10)
    for a, b in zip(stats.old_logprobs, want_stats.old_logprobs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    plain, _ = gradients(model, batches, share_prompt=False, skip_zero_advantage=False, micro_batch_rows=rows_per_forward)
    assert_same_gradient(plain, want, 1e-10)  # whole rows of several questions, right-padded


def test_ppo_kl_and_rollout_correction_across_questions(model):
    """A second PPO epoch (the first epoch's log-probabilities read back by question), the KL penalty (the
    reference's log-probabilities likewise) and token-tis over sampler log-probabilities: 64 rows a forward gives
    the gradients of one row a forward."""
    batches = questions(sampler=True)
    reference = copy.deepcopy(model).requires_grad_(False)
    loss = PolicyLoss(kl_coef=0.1, rollout_correction="token-tis", correction_cap=1.5)
    results = {}
    for rows in (1, 64):
        first_grads, first = gradients(model, batches, micro_batch_rows=rows, loss=loss, reference=reference)
        with torch.no_grad():  # a policy that moved: the ratio is no longer 1
            moved = copy.deepcopy(model)
            for p, g in zip(moved.parameters(), first_grads.values()):
                p.add_(g, alpha=0.5)
        second_grads, second = gradients(moved, batches, micro_batch_rows=rows, loss=loss, first_epoch=first)
        results[rows] = first_grads, first, second_grads, second
    (g1, s1, h1, t1), (g64, s64, h64, t64) = results[1], results[64]
    assert_same_gradient(g64, g1, 1e-10)
    assert_same_gradient(h64, h1, 1e-10)
    assert s64.sampler_tokens == s1.sampler_tokens > 0 and s64.sampler_gap_max == pytest.approx(s1.sampler_gap_max)
    assert t64.approx_kl == pytest.approx(t1.approx_kl, rel=1e-6) and t64.kl_ref == pytest.approx(t1.kl_ref, rel=1e-6)
    for a, b in zip(s64.correction_weights + s64.ref_logprobs, s1.correction_weights + s1.ref_logprobs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_several_prompts_forward_equals_each_whole_sequence(model):
    """hidden_states_shared_prefix of several right-padded prompts gives each row what hidden_states gives on its
    own prompt + row (windows binding: prompt 150 + row 40 > 128)."""
    gen = torch.Generator().manual_seed(3)
    lengths = [150, 7, 90]
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    padded = torch.stack([torch.cat([p, torch.zeros(150 - len(p), dtype=torch.long)]) for p in prompts])
    rows = torch.randint(1, VOCAB, (4, 40), generator=gen)
    row_prompt = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        prompt_hidden, rows_hidden = model.hidden_states_shared_prefix(padded, rows, torch.tensor(lengths), row_prompt)
        for b, q in enumerate(row_prompt.tolist()):
            whole = model.hidden_states(torch.cat([prompts[q], rows[b]])[None])[0]
            torch.testing.assert_close(rows_hidden[b], whole[lengths[q]:], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(prompt_hidden[q, :lengths[q]], whole[:lengths[q]], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("softcap", [15.0, 20.0])
def test_chunked_head_equals_the_plain_logits(dtype, softcap):
    """sampled_logprobs_and_entropy, in chunks of 5 tokens, against logprobs_and_entropy of the whole logits (vocab
    300 cropped from 320 rows, each softcap of the generations): log-probabilities, mean entropy, and gradients wrt
    the hidden states and the head's weight (the padded rows' zero)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(320, 16, generator=gen) * 0.5).to(dtype).requires_grad_()
    hidden = torch.randn(3, 8, 16, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (3, 8), generator=gen)
    targets[0, :3] = -1  # positions without a target
    upstream = torch.randn(3, 8, generator=gen, dtype=torch.float32)
    results = []
    for chunked in (False, True):
        if chunked:
            logp, entropy = sampled_logprobs_and_entropy(hidden, weight, targets, VOCAB, softcap, chunk_tokens=5)
        else:
            logp, entropy = logprobs_and_entropy(softcapped_logits(hidden, weight, VOCAB, softcap), targets)
        grad_hidden, grad_weight = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
        results.append((logp, entropy, grad_hidden, grad_weight))
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **tolerance)
    assert results[1][0].dtype == torch.float32 and not results[1][1].requires_grad
    assert torch.equal(results[1][3][VOCAB:], torch.zeros_like(results[1][3][VOCAB:]))


def test_the_chunked_head_under_cpu_bf16_autocast_matches_the_plain_one():
    """Under bf16 autocast the chunked head's backward computes in the forward's dtype (bf16 matmuls), as autograd
    does on the plain logits: the same log-probabilities and hidden-state gradient bit for bit (a backward recomputing
    in fp32 moves the latter by ~6e-3), the weight's within bf16 rounding (summed chunk by chunk)."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randn(320, 16, generator=gen) * 0.5).requires_grad_()
    hidden = torch.randn(40, 16, generator=gen).requires_grad_()
    targets = torch.randint(0, VOCAB, (40,), generator=gen)
    results = []
    for chunked in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if chunked:
                logp, _ = sampled_logprobs_and_entropy(hidden, weight, targets, VOCAB, 15.0, chunk_tokens=16)
            else:
                logp, _ = logprobs_and_entropy(softcapped_logits(hidden, weight, VOCAB, 15.0), targets)
        results.append((logp, *torch.autograd.grad(logp.sum(), (hidden, weight))))
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype
    assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1])
    torch.testing.assert_close(results[1][2], results[0][2], rtol=1e-2, atol=1e-2)


def test_more_rows_per_forward_issue_fewer_kernels():
    """The meta-device count of a training step (count_train_step_ops) on a tiny model: 4 questions of 8 rows, a
    forward of 8 rows (one question), 16 (two) or 64 (all four): each step up issues fewer kernels, and the count
    runs to the end of the pass (it would raise otherwise)."""
    with torch.device("meta"):
        model = GPT(tiny_config(sequence_len=64, vocab_size=VOCAB, window_pattern="SL"), "smear")
    kernels = [count_train_step_ops(model, questions=4, rows=8, prompt_len=12, completion_len=10,
                                    rows_per_forward=n).kernels for n in (8, 16, 64)]
    assert 0 < kernels[2] < kernels[1] < kernels[0], kernels


def test_a_count_cut_short_by_a_read_mid_pass_is_refused(monkeypatch):
    """A read back to the host in the pass's second forward (planted in to_device) would count one forward of four,
    every parameter already holding a gradient from the first: the count refuses it and names where it stopped,
    instead of giving a short number."""
    with torch.device("meta"):
        model = GPT(tiny_config(sequence_len=64, vocab_size=VOCAB), "smear")
    real, forwards = policy_gradient._backward_chunk, []

    def second_reads(*args, **kwargs):
        forwards.append(1)
        if len(forwards) == 2:
            torch.zeros(1, device="meta").tolist()
        return real(*args, **kwargs)

    monkeypatch.setattr(policy_gradient, "_backward_chunk", second_reads)
    with pytest.raises(RuntimeError, match=r"read back to the host before its end, in .*second_reads"):
        count_train_step_ops(model, questions=4, rows=8, prompt_len=12, completion_len=10, rows_per_forward=8)
    assert len(forwards) == 2 and all(p.grad is not None for p in model.parameters())


def test_a_forward_without_sampled_tokens_tallies_no_gap():
    """A forward with no sampled token (rows trained whatever their advantage, as bench_rl's plain configs do, all of
    them forced tool output) adds nothing to the sampler-gap sums: the max of no tokens was a crash (torch's max of an
    empty tensor)."""
    tally = _Tally(old_logprobs=[], ref_logprobs=None)
    tally.add_gap(torch.tensor([0.5, -0.25]), torch.tensor([True, True]), torch.zeros(()))
    tally.add_gap(torch.empty(0), torch.empty(0, dtype=torch.bool), torch.zeros(()))
    assert tally.sampler.tolist() == [2.0, 0.75, 0.5, pytest.approx((math.expm1(0.5) - 0.5) + (math.expm1(-0.25) + 0.25)), 0.0]
