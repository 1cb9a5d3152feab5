"""
One rank of tests/rl/test_rl_options.py's check that every loss normalization gives on 2 gloo ranks the
gradients of 1 process holding every question.

Run: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/support/rl_options_worker.py OUT.pt
Rank r takes questions r, r+2, ... of `questions()`. For every case of CASES, `run_case` runs a first epoch,
averages the gradient over ranks as the distributed optimizers do (sum / world size), takes the same
(sign-preserving, max-normalized) gradient step on every rank, then a second (clipped-ratio PPO) epoch; rank 0 saves both averaged gradients per case.
The questions, the cases and `run_case` live here so the test computes the 1-process reference with them.
"""

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from helpers import TableModel

from nanochat.rl.advantages import make_question_batch
from nanochat.rl.objective import LOSS_NORMS, PolicyLoss, step_counts
from nanochat.rl.policy_gradient import accumulate_policy_gradient, without_rejected_tokens
from nanochat.rl.teacher import Teacher

VOCAB, PAD, DEVICE_BATCH_SIZE, MAX_NEW_TOKENS, STEP = 32, 0, 2, 6, 0.5
# every normalization, plain and with truncated rows masked plus the KL penalty; then masking rollout corrections
# with the dropped tokens counted in the denominators and not (--rejected-tokens), a row dropped whole by geo-mask
CASES = [dict(loss_norm=norm, mask_truncated=masked, kl_coef=0.05 if masked else 0.0)
         for norm in LOSS_NORMS for masked in (False, True)] + [
    dict(loss_norm=norm, rollout_correction=correction, correction_cap=cap, rejected_in_denominator=counted)
    for norm, correction, cap in (("token", "token-mask", 1.5), ("sequence", "geo-mask", 2.0))
    for counted in (True, False)] + [
    # on-policy distillation (a teacher: run_case's): per-token advantages with each normalization's step counts,
    # the reward weighed or off, a CISPO second epoch, the KL penalty and a rollout correction beside it
    dict(loss_norm="pass", distill_coef=0.5), dict(loss_norm="token", distill_coef=1.0, reward_coef=0.0),
    dict(loss_norm="sequence", distill_coef=0.3, reward_coef=2.0, loss="cispo"),
    dict(loss_norm="constant", distill_coef=0.5, kl_coef=0.05, rollout_correction="token-tis", mask_truncated=True)]


def questions():
    """4 questions of 4 samples (2 passes of DEVICE_BATCH_SIZE rows), uneven lengths so the ranks hold different
    token counts; question 1 has no reward signal, every sample of question 2 was truncated, question 3 has
    forced (mask 0) tokens."""
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(1, VOCAB, (n,), generator=gen).tolist()
    spec = [  # (prompt length, completion lengths, rewards, truncated)
        (2, [3, 1, 4, 2], [1, 0, 0, 1], [False, False, True, False]),
        (1, [5, 2, 2, 3], [0, 0, 0, 0], [False, True, False, False]),
        (3, [6, 6, 6, 6], [1, 1, 0, 0.5], [True, True, True, True]),
        (1, [4, 1, 3, 5], [0, 1, 1, 1], [False, False, False, False]),
    ]
    batches, noise = [], torch.Generator().manual_seed(1)
    # the sampler's log-probabilities: about the tables' (log 1/32), moved by up to +-1, so that some tokens and rows
    # leave a correction's band and some stay
    sampler = lambda masks: [(-3.5 + 2 * float(torch.rand((), generator=noise)) - 1) if m else float("nan") for m in masks]
    for prompt_length, lengths, rewards, truncated in spec:
        completions = [(tokens(n), [0 if i % 3 == 1 else 1 for i in range(n)]) for n in lengths]
        batches.append(make_question_batch(tokens(prompt_length), completions, [float(r) for r in rewards], PAD,
                                           truncated=truncated, sampler_logprobs=[sampler(m) for _, m in completions]))
    return batches


def run_case(case, batches, examples_per_rank, average):
    """(first-epoch gradient, second-epoch gradient, second epoch's TrainStats), each gradient passed through
    `average` (the ranks' mean; identity in one process)."""
    torch.manual_seed(0)
    model = TableModel(VOCAB)
    torch.manual_seed(1)
    reference = TableModel(VOCAB)
    torch.manual_seed(2)
    teacher = Teacher(TableModel(VOCAB), nullcontext(), {})  # used where the case has a distill_coef
    loss = PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, clip_low=0.2, clip_high=0.28, **case)
    batches, dropped = without_rejected_tokens(model, batches, loss, DEVICE_BATCH_SIZE, "cpu", nullcontext())
    counts = step_counts(batches, loss.mask_truncated, "cpu")
    run = lambda first: accumulate_policy_gradient(model, batches, DEVICE_BATCH_SIZE, examples_per_rank, "cpu",
                                                   nullcontext(), loss=loss, counts=counts, reference=reference,
                                                   first_epoch=first, teacher=teacher)
    first = run(None)
    grad1 = average(model.table.grad.clone())
    with torch.no_grad():
        model.table -= STEP * grad1 / grad1.abs().max()  # a step the size of the logits, whatever the normalization
    model.table.grad = None
    second = run(first)
    return grad1, average(model.table.grad.clone()), second


def main(out):
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = questions()[rank::world_size]

    def average(grad):
        dist.all_reduce(grad)
        return grad / world_size

    results = {}
    for i, case in enumerate(CASES):
        grad1, grad2, _ = run_case(case, batches, len(batches), average)
        results[i] = (grad1, grad2)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
