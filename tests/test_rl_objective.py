"""The RL objective and batch assembly against hand-computed numbers."""

import math
from contextlib import nullcontext

import torch
from helpers import TableModel

from nanochat.rl.advantages import advantages_from_rewards, make_question_batch
from nanochat.rl.objective import pass_objective, token_logprobs_and_entropy
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
