"""The RL objective and batch assembly against hand-computed numbers; the training pass's default (on-policy) term
against nanochat's chat_rl loop, written out as nanochat writes it; the options' terms at the point where they reduce
to it."""

import copy
import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from helpers import TableModel, random_model, tiny_config
from oracles import pass_objective

from nanochat.rl.advantages import advantages_from_rewards, make_question_batch
from nanochat.rl.objective import (PolicyLoss, epoch_objective, k3_kl, kl_penalty, on_policy_objective, pass_denominators,
                                   ppo_objective, rollout_correction_weights, sampler_gap, token_logprobs_and_entropy)
from nanochat.rl.policy_gradient import accumulate_policy_gradient

PAD = 99


def example_batch():
    # sample A: 7 sampled, 8 forced (tool output), 9 sampled; sample B: only 7, then padding
    return make_question_batch([5, 6], [([7, 8, 9], [1, 0, 1]), ([7], [1])], [1.0, 0.0], PAD)


def test_batch_masks_prompt_forced_tokens_and_padding():
    b = example_batch()
    assert b.inputs.tolist() == [[5, 6, 7, 8], [5, 6, 7, PAD]]
    assert b.targets.tolist() == [[-1, 7, -1, 9], [-1, 7, -1, -1]]
    assert b.advantages.tolist() == [0.5, -0.5]
    assert b.completion_lengths == [3, 1]


def test_advantage_is_reward_minus_mean_without_std():
    assert advantages_from_rewards(torch.tensor([1.0, 0.0, 0.0, 0.0])).tolist() == [0.75, -0.25, -0.25, -0.25]
    assert advantages_from_rewards(torch.tensor([1.0, 1.0])).tolist() == [0.0, 0.0]


def test_pass_objective_hand_computed():
    b = example_batch()
    logp = torch.tensor([[-9.0, -0.5, -9.0, -0.25], [-9.0, -1.0, -9.0, -9.0]])
    # valid: A@1 (-0.5), A@3 (-0.25), B@1 (-1.0): 0.5*(-0.5) + 0.5*(-0.25) + (-0.5)*(-1.0) = 0.125 over 3 tokens
    got = pass_objective(logp, b.targets, b.advantages, num_passes=2, examples_per_rank=4)
    assert math.isclose(got.item(), 0.125 / (3 * 2 * 4), rel_tol=1e-6)


def test_pass_without_valid_tokens_is_zero():
    targets = torch.full((2, 3), -1)
    assert pass_objective(torch.randn(2, 3), targets, torch.tensor([1.0, -1.0]), 1, 1).item() == 0.0


def test_logprobs_and_entropy_of_known_distribution():
    # uniform over 4 tokens: logp = -log 4 everywhere, entropy = log 4
    logits = torch.zeros(1, 2, 4)
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[2, -1]]))
    assert torch.allclose(logp, torch.tensor([[-math.log(4), 0.0]]))
    assert math.isclose(entropy.item(), math.log(4), rel_tol=1e-6)
    # a peaked distribution has lower entropy: p = softmax([3, 0]) -> H = -sum p log p
    logits = torch.tensor([[[3.0, 0.0]]])
    p = torch.softmax(logits[0, 0], -1)
    _, entropy = token_logprobs_and_entropy(logits, torch.tensor([[0]]))
    assert math.isclose(entropy.item(), -(p * p.log()).sum().item(), rel_tol=1e-6)


def test_train_step_gradient_equals_hand_assembled_objective():
    """Two questions, 4 samples each, 2 passes of 2 rows: the accumulated gradient equals the gradient of
    sum over questions and passes of (sum logp*adv over the pass's valid tokens) / (valid * passes * questions)."""
    torch.manual_seed(0)
    q1 = make_question_batch([1, 2], [([3, 4], [1, 1]), ([3], [1]), ([5, 6, 7], [1, 0, 1]), ([8], [1])], [1, 0, 0, 1], PAD)
    q2 = make_question_batch([9], [([10], [1]), ([11, 12], [1, 1]), ([13], [1]), ([14, 15], [0, 1])], [0, 0, 1, 0], PAD)
    model = TableModel()
    objective = accumulate_policy_gradient(model, [q1, q2], device_batch_size=2, examples_per_rank=2,
                                           device="cpu", autocast=nullcontext()).objective
    got = model.table.grad.clone()

    model.table.grad = None
    expected_obj = 0.0
    for q in (q1, q2):
        for rows in (slice(0, 2), slice(2, 4)):
            logp_all = torch.log_softmax(model.table[q.inputs[rows]], -1)
            tgt = q.targets[rows]
            total = 0.0
            count = 0
            for i in range(tgt.size(0)):
                for t in range(tgt.size(1)):
                    if tgt[i, t] >= 0:
                        total = total + logp_all[i, t, tgt[i, t]] * q.advantages[rows][i]
                        count += 1
            expected_obj = expected_obj + total / (count * 2 * 2)
    (-expected_obj).backward()
    assert math.isclose(objective, expected_obj.item(), rel_tol=1e-5, abs_tol=1e-7)
    assert torch.allclose(got, model.table.grad, atol=1e-7)


def test_micro_batches_give_the_same_gradient_as_whole_passes():
    """After an out-of-memory the trainer halves the rows per forward; the pass denominator must stay the
    pass's, so the gradient is unchanged."""
    torch.manual_seed(1)
    q = make_question_batch([1, 2], [([3, 4, 5], [1, 1, 1]), ([3], [1]), ([6, 7], [1, 0]), ([8, 9], [1, 1])],
                            [1, 0, 0, 1], PAD)
    grads = []
    for micro in (None, 1):
        model = TableModel()
        torch.manual_seed(2)
        model.table.data = torch.randn(100, 100)
        accumulate_policy_gradient(model, [q], device_batch_size=4, examples_per_rank=1, device="cpu",
                                   autocast=nullcontext(), micro_batch_rows=micro)
        grads.append(model.table.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def nanochat_pass_objectives(logp, targets, advantages, device_batch_size, examples_per_rank):
    """nanochat's chat_rl (3c3a3d7), its training loop's lines for one question: logp (R, T) of the targets, 0 where
    target == -1 (cross_entropy's ignore_index); yields each pass's pg_obj."""
    num_passes = logp.size(0) // device_batch_size
    for pass_idx in range(num_passes):
        b0, b1 = pass_idx * device_batch_size, (pass_idx + 1) * device_batch_size
        pg_obj = (logp[b0:b1] * advantages[b0:b1].unsqueeze(-1)).sum()
        num_valid = (targets[b0:b1] >= 0).sum().clamp(min=1)
        yield pg_obj / (num_valid * num_passes * examples_per_rank)


def test_on_policy_term_is_nanochats_pass_objective_in_fp64():
    """on_policy_objective over a question's sampled tokens, with each row's A / D (pass_denominators), is the sum of
    nanochat's pass objectives: value and gradient, in float64 (one pass without a sampled token)."""
    torch.manual_seed(0)
    targets = torch.randint(0, 50, (6, 5))
    targets[torch.rand(6, 5) < 0.3] = -1
    targets[4:] = -1  # the last pass has no target
    logp = (-torch.rand(6, 5, dtype=torch.float64) * 3).requires_grad_(True)
    advantages = torch.randn(6, dtype=torch.float64)
    valid = targets >= 0
    weights = advantages / pass_denominators(targets, 2, 3).double()  # (R,) A / D
    ours = on_policy_objective(logp[valid], weights[valid.nonzero()[:, 0]])
    (ours_grad,) = torch.autograd.grad(ours, logp)
    theirs = sum(nanochat_pass_objectives(torch.where(valid, logp, 0.0), targets, advantages, 2, 3))
    (theirs_grad,) = torch.autograd.grad(theirs, logp)
    assert math.isclose(ours.item(), theirs.item(), rel_tol=1e-14)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-14, atol=1e-16)


def test_first_epoch_gradient_is_nanochats_loop_on_a_tiny_gpt():
    """accumulate_policy_gradient at nanochat's defaults (fp32; prompts once per forward, zero-advantage rows skipped,
    the chunked head; forwards of one pass or across questions) against nanochat's loop on a float64 copy of the
    model, logits as GPT.logits computes them: per pass, logp = -cross_entropy(reduction='none'), pg_obj, loss =
    -pg_obj, backward. Gradients agree to fp32's rounding (~1e-7 here); a wrong denominator or a lost row is O(1)."""
    V, B = 64, 2
    questions = [([5, 6, 7], [([8, 9, 10], [1, 1, 1]), ([11], [1]), ([12, 13, 14, 15], [1, 0, 0, 1]), ([16, 17], [1, 1])],
                  [1.0, 0.0, 0.0, 1.0]),
                 ([20, 21], [([22], [1]), ([23, 24, 25], [1, 1, 1]), ([26, 27], [0, 1]), ([28, 29, 30, 31, 32], [1] * 5)],
                  [0.0, 0.0, 1.0, 0.0]),
                 ([40], [([41, 42], [1, 1]), ([43], [1]), ([44], [1]), ([45, 46], [1, 0])], [1.0] * 4)]  # all alike: A = 0
    batches = [make_question_batch(prompt, completions, rewards, 0) for prompt, completions, rewards in questions]
    model = random_model(tiny_config(sequence_len=32, vocab_size=V), seed=3)
    reference = copy.deepcopy(model).double()
    softcap = reference.generation.softcap
    for batch in batches:
        logits = softcap * torch.tanh(F.linear(reference.hidden_states(batch.inputs), reference.lm_head.weight)[..., :V]
                                      / softcap)
        logp = -F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-1,
                                reduction="none").view_as(batch.inputs)  # (R, T)
        for pg_obj in nanochat_pass_objectives(logp, batch.targets, batch.advantages.double(), B, len(batches)):
            loss = -pg_obj
            loss.backward(retain_graph=True)
    for micro_batch_rows in (None, 8):
        model.zero_grad(set_to_none=True)
        accumulate_policy_gradient(model, batches, device_batch_size=B, examples_per_rank=len(batches), device="cpu",
                                   autocast=nullcontext(), micro_batch_rows=micro_batch_rows)
        for (name, p), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.double(), want.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss", ["pg", "cispo"])
def test_ppo_term_at_ratio_1_has_the_on_policy_gradient(loss):
    """The terms composed onto the on-policy one reduce to it where they should: a PPO epoch's term (pg, cispo)
    against the policy that sampled (ratio 1) has its gradient, A / D per token; a correction weight of 1 and a
    reference equal to the policy (k3 = 0, no gradient) change nothing."""
    torch.manual_seed(1)
    logp = (-torch.rand(7, dtype=torch.float64) * 3).requires_grad_(True)
    advantages, denominators = torch.randn(7, dtype=torch.float64), torch.randint(1, 9, (7,)).double()
    row_index = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    (on_policy,) = torch.autograd.grad(on_policy_objective(logp, advantages / denominators), logp)
    policy_loss = PolicyLoss(loss=loss, clip_low=0.2, clip_high=0.28)
    ppo, clipped = ppo_objective(policy_loss, logp, logp.detach(), advantages, denominators, row_index, 3,
                                 correction=torch.ones(7, dtype=torch.float64))
    penalty = kl_penalty(0.5, k3_kl(logp, logp.detach()), denominators)
    (ppo_grad,) = torch.autograd.grad(ppo - penalty, logp)
    torch.testing.assert_close(ppo_grad, on_policy, rtol=1e-14, atol=0.0)
    assert not clipped.any() and penalty.item() == 0.0


def test_rollout_correction_weights_hand_computed():
    """token-tis caps each known token's exp(logp - sampler logp) at the cap (unknown: 1); sequence-mask keeps a row
    whose summed gap lies within +-log(cap), else drops all its tokens; each counts the tokens it changed."""
    logp = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0], dtype=torch.float64)
    sampler = torch.tensor([-1.0, -2.0 - math.log(3), -1.5, float("nan"), -2.0], dtype=torch.float64)
    gap, known = sampler_gap(logp, sampler)  # 0, log 3, 1, (unknown) 0, -1
    assert known.tolist() == [True, True, True, False, True] and gap[3] == 0.0
    row_index = torch.tensor([0, 0, 1, 1, 2])
    weights, changed = rollout_correction_weights(PolicyLoss(rollout_correction="token-tis", correction_cap=2.0), gap,
                                                  known, row_index, 3, logp.dtype)
    torch.testing.assert_close(weights, torch.tensor([1.0, 2.0, 2.0, 1.0, math.exp(-1)], dtype=torch.float64))
    assert int(changed) == 2
    # the rows' summed gaps: log 3 = 1.099, 1 and -1; log 3.5 = 1.253 keeps them all, log 2.9 = 1.065 drops row 0
    for cap, kept in ((3.5, [1, 1, 1, 1, 1]), (2.9, [0, 0, 1, 1, 1])):
        weights, changed = rollout_correction_weights(PolicyLoss(rollout_correction="sequence-mask", correction_cap=cap),
                                                      gap, known, row_index, 3, logp.dtype)
        assert weights.tolist() == kept and int(changed) == kept.count(0)
    assert rollout_correction_weights(PolicyLoss(), gap, known, row_index, 3, logp.dtype)[0] is None


@pytest.mark.parametrize("first, kl_coef", [(True, 0.0), (True, 0.1), (False, 0.0), (False, 0.1)])
def test_epoch_objective_composes_each_option_as_written_out_by_hand(first, kl_coef):
    """objective.epoch_objective, the one place a forward's terms are chosen by the loss's options, against the terms
    written out here for 4 tokens of 2 rows: the first epoch sum(logp * w * c) (w = A/D, c the correction's weights),
    a later one PPO's sum(min(rho * A, clip(rho) * A) * c / D) with rho = exp(logp - old), minus kl_coef * sum(k3 / D)
    with k3 = exp(ref - logp) - (ref - logp) - 1; the tallies: the tokens whose clipped term is the smaller, sum of
    exp(r) - r - 1 with r = logp - old, sum of k3."""
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1], dtype=torch.float64)
    old = torch.tensor([-1.3, -0.5, -1.0, -0.2], dtype=torch.float64)
    ref = torch.tensor([-0.9, -0.7, -2.5, -0.1], dtype=torch.float64)
    rows = {"advantages": torch.tensor([0.5, 0.5, -1.0, -1.0], dtype=torch.float64),
            "denominators": torch.tensor([4.0, 4.0, 8.0, 8.0], dtype=torch.float64)}
    rows["weights"] = rows["advantages"] / rows["denominators"]
    correction = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    loss = PolicyLoss(clip_low=0.2, clip_high=0.28, kl_coef=kl_coef)
    terms = epoch_objective(loss, first, logp, rows.__getitem__, torch.tensor([0, 0, 1, 1]), 2, correction,
                            old_logp=None if first else old, ref_logp=ref if kl_coef else None)
    w, a, d = rows["weights"].tolist(), rows["advantages"].tolist(), rows["denominators"].tolist()
    lp, o, r, c = logp.tolist(), old.tolist(), ref.tolist(), correction.tolist()
    if first:
        want = sum(lp[t] * w[t] * c[t] for t in range(4))
    else:
        rho = [math.exp(lp[t] - o[t]) for t in range(4)]
        clip = [min(max(x, 0.8), 1.28) for x in rho]
        want = sum(min(rho[t] * a[t], clip[t] * a[t]) * c[t] / d[t] for t in range(4))
        assert terms.clipped.item() == sum(clip[t] * a[t] < rho[t] * a[t] for t in range(4)) == 2
        assert terms.approx_kl.item() == pytest.approx(sum(math.exp(lp[t] - o[t]) - (lp[t] - o[t]) - 1 for t in range(4)))
    k3 = [math.exp(r[t] - lp[t]) - (r[t] - lp[t]) - 1 for t in range(4)]
    want -= kl_coef * sum(k3[t] / d[t] for t in range(4))
    assert terms.objective.item() == pytest.approx(want, rel=1e-12)
    assert (terms.clipped is None) == first and (terms.kl_ref is None) == (kl_coef == 0)
    if kl_coef:
        assert terms.kl_ref.item() == pytest.approx(sum(k3))
