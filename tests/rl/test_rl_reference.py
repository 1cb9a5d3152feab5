"""Every algorithm option of nanochat/rl/objective.py against an independent reference: the objective of a small step
written out from the formulas (torch.log_softmax and arithmetic on the raw token lists; no nanochat.rl.objective helper),
compared with accumulate_policy_gradient's TrainStats.objective and the gradient it accumulates.

The model is helpers.TableModel, whose logits for the next token are a table row picked by the current token,
so a sampled token's log-probability is log_softmax(table[previous token])[token]. The reference runs in float64
on a copy of the table; the code under test in float32.

The formulas (module docstring of nanochat/rl/objective.py, and the papers it cites). Per question q with rewards r,
row i, sampled token t (mask 1) of row i, and D_i the row's denominator:
    A_i         = r_i - mean(r_q)                         (GRPO's advantage std: / (population std + 1e-4))
    objective   = sum_i sum_t A_i * logp_it / D_i
    D_i, pass       sampled tokens of i's pass (device_batch_size rows) * passes per question * questions
    D_i, token      sampled tokens of the whole step                                   (DAPO)
    D_i, sequence   sampled tokens of row i * rows of the step with a sampled token
    D_i, constant   rows of q * max_new_tokens * questions of the step                 (Dr. GRPO)
    mask truncated  rows cut at max_new_tokens have no token and count in no denominator
    PPO epoch 2     A_i * logp_it -> min(rho A_i, clip(rho, 1 - clip_low, 1 + clip_high) A_i), rho = exp(logp - old)
      GSPO          -> min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i) for each token of row i,
                       s_i = exp(mean over row i's sampled tokens of (logp - old))      (Zheng et al. 2025)
      CISPO         -> sg(clip(rho, 1 - clip_low, 1 + clip_high)) A_i logp_it            (MiniMax-M1)
    KL              - kl_coef * sum_i sum_t k3_it / D_i,  k3 = exp(ref - logp) - (ref - logp) - 1
    rollout correction, with s_it the sampler's log-probability of the token (here: under a second table) and
    w_it = exp(logp_it - s_it) taken as a constant (no gradient flows through it), the policy term (not the KL
    term) of each token times
        token-tis       min(w_it, cap)
        sequence-mask   1 if |sum_t log w_it| <= log(cap) over row i's sampled tokens, else 0
        geo-mask        1 if |mean_t log w_it| <= log(cap) over row i's sampled tokens, else 0
        token-mask      1 if |log w_it| <= log(cap), else 0
    In a PPO epoch after the first the weights are the first epoch's (logp under the policy that sampled).
"""

import math
from contextlib import nullcontext

import pytest
import torch
from helpers import TableModel

from nanochat.rl.advantages import make_question_batch
from nanochat.rl.objective import PolicyLoss
from nanochat.rl.policy_gradient import accumulate_policy_gradient

VOCAB, PAD, DEVICE_BATCH_SIZE, MAX_NEW_TOKENS = 8, 0, 2, 5
# (prompt, [(completion tokens, masks (0 = forced by the tool), reward, truncated at MAX_NEW_TOKENS)])
QUESTIONS = [
    ([1, 2], [([3, 4, 5], [1, 1, 1], 1.0, False),
              ([6], [1], 0.0, False),
              ([3, 7, 2, 4, 1], [1, 0, 0, 1, 1], 0.0, True),
              ([5, 5], [1, 1], 1.0, False)]),
    ([4], [([2, 2], [1, 1], 1.0, False),
           ([7, 1, 3], [1, 1, 1], 0.0, False),
           ([6, 6, 6, 6, 6], [1, 1, 1, 1, 1], 0.0, True),
           ([1], [1], 0.0, False)]),
    ([3, 3, 1], [([1, 2], [1, 1], 0.0, False),   # no reward signal: advantages 0, tokens still counted
                 ([2], [1], 0.0, False),
                 ([4, 4, 4], [1, 1, 1], 0.0, False),
                 ([5], [1], 0.0, False)]),
]


def sampled_tokens(prompt, tokens, masks):
    """(previous token, token) of each sampled position of one row."""
    sequence = prompt + tokens
    return [(sequence[len(prompt) + j - 1], tokens[j]) for j in range(len(tokens)) if masks[j]]


def reference_objective(table, loss_norm="pass", mask_truncated=False, advantage_std=False, kl_coef=0.0,
                        ref_table=None, old_table=None, clip_low=0.2, clip_high=0.2, rollout_correction="none",
                        correction_cap=2.0, sampler_table=None, loss="pg", rejected_in_denominator=True):
    """The step's objective (a float64 scalar, differentiable in `table`) and the number of clipped tokens, or
    with a rollout correction the number of corrected tokens among the rows trained (a non-zero advantage, or any
    with the KL penalty).
    old_table: a PPO epoch after the first, whose old log-probabilities are the ones under old_table.
    sampler_table: the sampler's log-probabilities are the ones under it (a rollout correction needs them)."""
    rows = []  # (question, row in question, advantage, [(prev, token)])
    for q, (prompt, samples) in enumerate(QUESTIONS):
        rewards = [reward for _, _, reward, _ in samples]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        for i, (tokens, masks, reward, truncated) in enumerate(samples):
            advantage = (reward - mean) / (std + 1e-4) if advantage_std else reward - mean
            pairs = [] if (mask_truncated and truncated) else sampled_tokens(prompt, tokens, masks)
            rows.append((q, i, advantage, pairs))
    logp_of = lambda t, prev, token: torch.log_softmax(t[prev], dim=-1)[token]
    if not rejected_in_denominator and rollout_correction in ("sequence-mask", "geo-mask", "token-mask"):
        rows = [(q, i, advantage, kept_by_mask(pairs, rollout_correction, correction_cap,
                                               lambda prev, token: logp_of(table if old_table is None else old_table,
                                                                           prev, token) - logp_of(sampler_table, prev, token)))
                for q, i, advantage, pairs in rows]  # the peers' rule: a dropped token is in no count below
    step_tokens = sum(len(pairs) for *_, pairs in rows)
    step_sequences = sum(1 for *_, pairs in rows if pairs)
    counted_rows = lambda q: sum(1 for qq, i, _, _ in rows if qq == q and not (mask_truncated and QUESTIONS[q][1][i][3]))
    step_questions = sum(1 for q in range(len(QUESTIONS)) if counted_rows(q))
    num_questions = len(QUESTIONS)

    def denominator(q, i, pairs):
        if loss_norm == "pass":
            passes = len(QUESTIONS[q][1]) // DEVICE_BATCH_SIZE
            first = i // DEVICE_BATCH_SIZE * DEVICE_BATCH_SIZE
            in_pass = sum(len(p) for qq, ii, _, p in rows if qq == q and first <= ii < first + DEVICE_BATCH_SIZE)
            return max(in_pass, 1) * passes * num_questions
        if loss_norm == "token":
            return step_tokens
        if loss_norm == "sequence":
            return len(pairs) * step_sequences
        return counted_rows(q) * MAX_NEW_TOKENS * step_questions  # constant

    sampling_table = table if old_table is None else old_table  # the policy that sampled: the weights' logp
    objective, clipped, corrected = torch.zeros((), dtype=torch.float64), 0, 0
    for q, i, advantage, pairs in rows:
        if not pairs:
            continue
        D = denominator(q, i, pairs)
        log_w = [float((logp_of(sampling_table, prev, token) - logp_of(sampler_table, prev, token)).detach())
                 for prev, token in pairs] if rollout_correction != "none" else [0.0] * len(pairs)  # plain floats: no grad
        row_kept = abs(sum(log_w)) <= math.log(correction_cap)
        row_kept_geo = abs(sum(log_w) / len(log_w)) <= math.log(correction_cap)
        if old_table is not None and loss == "gspo":  # the row's ratio: the geometric mean of its tokens'
            s = torch.exp(sum(logp_of(table, prev, token) - logp_of(old_table, prev, token) for prev, token in pairs)
                          / len(pairs))
            unclipped, clipped_term = s * advantage, torch.clamp(s, 1 - clip_low, 1 + clip_high) * advantage
            row_term, row_clipped = torch.minimum(unclipped, clipped_term), bool(clipped_term < unclipped)
        for (prev, token), lw in zip(pairs, log_w):
            logp = logp_of(table, prev, token)
            if old_table is None:
                term = advantage * logp
            elif loss == "gspo":
                term = row_term
                clipped += int(row_clipped)
            elif loss == "cispo":
                rho = float(torch.exp(logp - logp_of(old_table, prev, token)).detach())  # a float: no gradient through it
                term = min(max(rho, 1 - clip_low), 1 + clip_high) * advantage * logp
                clipped += int(not 1 - clip_low <= rho <= 1 + clip_high and (advantage != 0 or kl_coef > 0))  # trained
            else:
                rho = torch.exp(logp - logp_of(old_table, prev, token))
                unclipped, clipped_term = rho * advantage, torch.clamp(rho, 1 - clip_low, 1 + clip_high) * advantage
                term = torch.minimum(unclipped, clipped_term)
                clipped += int(clipped_term < unclipped)
            if rollout_correction == "token-tis":
                term = term * min(math.exp(lw), correction_cap)
                corrected += int(lw > math.log(correction_cap) and (advantage != 0 or kl_coef > 0))
            elif rollout_correction in ("sequence-mask", "geo-mask", "token-mask"):
                kept = {"sequence-mask": row_kept, "geo-mask": row_kept_geo,
                        "token-mask": abs(lw) <= math.log(correction_cap)}[rollout_correction]
                term = term * float(kept)
                corrected += int(not kept and (advantage != 0 or kl_coef > 0))
            if kl_coef:
                log_ratio = logp_of(ref_table, prev, token) - logp
                term = term - kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
            objective = objective + term / D
    return objective, corrected if rollout_correction != "none" else clipped


def kept_by_mask(pairs, correction, cap, log_w_of):
    """The (prev, token) pairs of one row that a masking correction keeps, log w of each from log_w_of(prev, token)."""
    log_w = [float(log_w_of(prev, token).detach()) for prev, token in pairs]
    if correction == "token-mask":
        return [pair for pair, lw in zip(pairs, log_w) if abs(lw) <= math.log(cap)]
    ratio = sum(log_w) / (len(log_w) if correction == "geo-mask" else 1) if log_w else 0.0
    return pairs if abs(ratio) <= math.log(cap) else []


def sampler_logprobs(sampler_table, prompt, tokens, masks):
    """The sampler's log-probability (float32, as the engine records it) of each token of one row; nan where
    the token was forced."""
    sequence = prompt + tokens
    return [float(torch.log_softmax(sampler_table[sequence[len(prompt) + j - 1]].float(), -1)[tokens[j]]) if masks[j]
            else float("nan") for j in range(len(tokens))]


def batches(advantage_std=False, sampler_table=None):
    return [make_question_batch(prompt, [(tokens, masks) for tokens, masks, _, _ in samples],
                                [reward for _, _, reward, _ in samples], PAD,
                                truncated=[truncated for *_, truncated in samples], scale_by_std=advantage_std,
                                sampler_logprobs=None if sampler_table is None else
                                [sampler_logprobs(sampler_table, prompt, tokens, masks) for tokens, masks, _, _ in samples])
            for prompt, samples in QUESTIONS]


def table_model(seed, scale=1.0):
    torch.manual_seed(seed)
    model = TableModel(VOCAB)
    with torch.no_grad():
        model.table.mul_(scale)
    return model


def reference_gradient(model, **options):
    """(objective, d objective / d table, clipped tokens) of the reference at the model's table."""
    table = model.table.detach().double().requires_grad_(True)
    objective, clipped = reference_objective(table, **options)
    objective.backward()
    return objective.item(), table.grad, clipped


CASES = {
    "pass (nanochat)": {},
    "token (DAPO)": dict(loss_norm="token"),
    "sequence": dict(loss_norm="sequence"),
    "constant (Dr. GRPO)": dict(loss_norm="constant"),
    "pass, truncated masked": dict(mask_truncated=True),
    "constant, truncated masked": dict(loss_norm="constant", mask_truncated=True),
    "advantage std (GRPO)": dict(advantage_std=True),
    "kl penalty": dict(kl_coef=0.3),
    "token, truncated masked, kl": dict(loss_norm="token", mask_truncated=True, kl_coef=0.3),
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_first_epoch_objective_and_gradient_equal_the_reference(options):
    model, reference = table_model(0), table_model(1)
    loss_options = {k: v for k, v in options.items() if k != "advantage_std"}
    stats = accumulate_policy_gradient(model, batches(options.get("advantage_std", False)), DEVICE_BATCH_SIZE,
                                       len(QUESTIONS), "cpu", nullcontext(),
                                       loss=PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, **loss_options),
                                       reference=reference)
    want, grad, _ = reference_gradient(model, ref_table=reference.table.detach().double(), **options)
    assert stats.objective == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert want != 0 and grad.abs().max() > 0
    torch.testing.assert_close(model.table.grad.double(), -grad, rtol=1e-4, atol=1e-6)  # the code descends -objective


@pytest.mark.parametrize("options", [dict(), dict(loss_norm="token", clip_high=0.28), dict(loss_norm="sequence", kl_coef=0.3)],
                         ids=["pass", "token, clip-high 0.28", "sequence, kl"])
def test_ppo_second_epoch_equals_the_reference(options):
    """Epoch 1 records the sampled tokens' log-probabilities under the model that sampled (`old`); epoch 2 runs
    on a moved table (`new`), far enough that some ratios leave the clip range on both sides."""
    old, new, reference = table_model(0), table_model(0), table_model(1)
    with torch.no_grad():
        new.table.add_(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5)) * 0.4)
    loss = PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, clip_low=0.2, **options)
    first = accumulate_policy_gradient(old, batches(), DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu", nullcontext(), loss=loss,
                                       reference=reference)
    stats = accumulate_policy_gradient(new, batches(), DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu", nullcontext(), loss=loss,
                                       reference=reference, first_epoch=first)
    want, grad, clipped = reference_gradient(new, old_table=old.table.detach().double(),
                                             ref_table=reference.table.detach().double(), **options)
    assert stats.objective == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(new.table.grad.double(), -grad, rtol=1e-4, atol=1e-6)
    assert 0 < clipped < stats.tokens and stats.clip_fraction == pytest.approx(clipped / stats.tokens)


# ----------------------------------------------------------------------------- rollout corrections

def sampler_table():
    """The sampler's table: the policy's (table_model(0)) moved by noise of scale 0.5, enough that, with cap
    1.5, some tokens' weights are capped and some rows' sequence ratios leave [1/cap, cap], but not all."""
    return (table_model(0).table.detach() + torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(7)) * 0.5)


CORRECTION_CASES = {
    "token-tis, pass": dict(rollout_correction="token-tis", correction_cap=1.5),
    "token-tis, token, truncated masked, kl": dict(rollout_correction="token-tis", correction_cap=1.5, loss_norm="token",
                                                  mask_truncated=True, kl_coef=0.3),
    "sequence-mask, pass": dict(rollout_correction="sequence-mask", correction_cap=1.5),
    "sequence-mask, sequence, kl": dict(rollout_correction="sequence-mask", correction_cap=1.5, loss_norm="sequence",
                                        kl_coef=0.3),
    "geo-mask, pass": dict(rollout_correction="geo-mask", correction_cap=1.1),
    "geo-mask, token, kl": dict(rollout_correction="geo-mask", correction_cap=1.1, loss_norm="token", kl_coef=0.3),
    "token-mask, pass": dict(rollout_correction="token-mask", correction_cap=1.5),
    "token-mask, sequence, truncated masked, kl": dict(rollout_correction="token-mask", correction_cap=1.5,
                                                       loss_norm="sequence", mask_truncated=True, kl_coef=0.3),
}


def sampled_on_trained_rows(kl):
    """Sampled tokens of the rows trained (the rows whose gap and correction are tallied): those with a non-zero
    advantage, or all of them with the KL penalty."""
    return sum(sum(masks) for prompt, samples in QUESTIONS for tokens, masks, reward, _ in samples
               if kl or reward != sum(r for *_, r, _ in samples) / len(samples))


@pytest.mark.parametrize("options", CORRECTION_CASES.values(), ids=CORRECTION_CASES.keys())
def test_rollout_correction_objective_and_gradient_equal_the_reference(options):
    """The correction's weights are constants of the objective: the gradient is the weighted policy gradient.
    Guards against a weight that carries gradient (a missing .detach()), which leaves the objective unchanged."""
    model, reference, sampler = table_model(0), table_model(1), sampler_table()
    loss_options = {k: v for k, v in options.items() if k != "advantage_std"}
    stats = accumulate_policy_gradient(model, batches(sampler_table=sampler), DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu",
                                       nullcontext(), loss=PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, **loss_options),
                                       reference=reference)
    want, grad, corrected = reference_gradient(model, ref_table=reference.table.detach().double(),
                                               sampler_table=sampler.double(), **options)
    plain, plain_grad, _ = reference_gradient(model, ref_table=reference.table.detach().double(),
                                              **{k: v for k, v in options.items() if "correction" not in k})
    assert abs(want - plain) > 1e-3 and (grad - plain_grad).abs().max() > 1e-3  # the correction changes both
    assert stats.objective == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(model.table.grad.double(), -grad, rtol=1e-4, atol=1e-6)
    if not options.get("mask_truncated"):
        assert stats.sampler_tokens == sampled_on_trained_rows(options.get("kl_coef", 0) > 0)
        assert 0 < corrected < stats.sampler_tokens and stats.corrected_fraction == pytest.approx(corrected / stats.sampler_tokens)


@pytest.mark.parametrize("correction", ["token-tis", "sequence-mask", "geo-mask", "token-mask"])
def test_rollout_correction_in_the_second_ppo_epoch_equals_the_reference(correction):
    """--ppo-epochs=2: epoch 2's clipped surrogate is weighted by epoch 1's correction (the sampler's tokens do
    not change between epochs), computed from the policy that sampled, not from the moved one."""
    old, new, sampler = table_model(0), table_model(0), sampler_table()
    with torch.no_grad():
        new.table.add_(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5)) * 0.4)
    loss = PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, rollout_correction=correction, correction_cap=1.5)
    first = accumulate_policy_gradient(old, batches(sampler_table=sampler), DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu",
                                       nullcontext(), loss=loss)
    stats = accumulate_policy_gradient(new, batches(sampler_table=sampler), DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu",
                                       nullcontext(), loss=loss, first_epoch=first)
    want, grad, _ = reference_gradient(new, old_table=old.table.detach().double(), sampler_table=sampler.double(),
                                       rollout_correction=correction, correction_cap=1.5)
    plain, _, _ = reference_gradient(new, old_table=old.table.detach().double())
    assert abs(want - plain) > 1e-3
    assert stats.objective == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(new.table.grad.double(), -grad, rtol=1e-4, atol=1e-6)


def test_the_geometric_mask_keeps_a_long_row_the_product_mask_drops_and_the_token_mask_drops_tokens():
    """A row of 8 tokens each 0.3 apart in log-probability (cap 2, band log 2 = 0.69): its product ratio, e^2.4,
    leaves the band (sequence-mask drops the row), its geometric mean e^0.3 does not (geo-mask keeps it). A row
    of gaps 0.1, 0.8, -0.9, 0.2 and one unknown: token-mask drops the two tokens out of the band, and only them; the
    geometric mean of its four known gaps, 0.05, keeps it; a row whose mean leaves the band on the low side goes."""
    from nanochat.rl.objective import rollout_correction_weights
    gap = torch.tensor([0.3] * 8 + [0.1, 0.8, -0.9, 0.2, 0.0] + [-0.8, -0.75], dtype=torch.float64)
    known = torch.tensor([True] * 12 + [False] + [True, True])
    row_index = torch.tensor([0] * 8 + [1] * 5 + [2] * 2)

    def weights(correction):
        loss = PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, rollout_correction=correction, correction_cap=2.0)
        w, changed = rollout_correction_weights(loss, gap, known, row_index, 3, torch.float64)
        return w.tolist(), int(changed)

    assert weights("sequence-mask") == ([0.0] * 8 + [1.0] * 5 + [0.0] * 2, 10)
    assert weights("geo-mask") == ([1.0] * 8 + [1.0] * 5 + [0.0] * 2, 2)
    assert weights("token-mask") == ([1.0] * 8 + [1.0, 0.0, 0.0, 1.0, 1.0] + [0.0, 0.0], 4)


PEERS_CASES = {
    "token-mask, pass": dict(rollout_correction="token-mask", correction_cap=1.5),
    "token-mask, token, kl": dict(rollout_correction="token-mask", correction_cap=1.5, loss_norm="token", kl_coef=0.3),
    "sequence-mask, sequence": dict(rollout_correction="sequence-mask", correction_cap=1.5, loss_norm="sequence"),
    "geo-mask, token, truncated masked": dict(rollout_correction="geo-mask", correction_cap=1.1, loss_norm="token",
                                              mask_truncated=True),
}


@pytest.mark.parametrize("options", PEERS_CASES.values(), ids=PEERS_CASES.keys())
def test_rejected_tokens_out_of_the_denominators_equal_the_reference(options):
    """--rejected-in-denominator's peers' rule (slime, verl): the tokens a mask drops leave the denominators, from a
    no-grad forward of every counted row before the pass (without_rejected_tokens); the pass on what is left equals
    the reference that filters them out first, and differs from today's rule (they stay counted)."""
    from nanochat.rl.objective import step_counts
    from nanochat.rl.policy_gradient import without_rejected_tokens
    model, reference, sampler = table_model(0), table_model(1), sampler_table()
    loss = PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, rejected_in_denominator=False, **options)
    kept, dropped = without_rejected_tokens(model, batches(sampler_table=sampler), loss, DEVICE_BATCH_SIZE, "cpu",
                                            nullcontext())
    stats = accumulate_policy_gradient(model, kept, DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu", nullcontext(), loss=loss,
                                       counts=step_counts(kept, loss.mask_truncated, "cpu"), reference=reference)
    want, grad, _ = reference_gradient(model, ref_table=reference.table.detach().double(), sampler_table=sampler.double(),
                                       rejected_in_denominator=False, **options)
    today, _, _ = reference_gradient(model, ref_table=reference.table.detach().double(), sampler_table=sampler.double(),
                                     **options)
    assert dropped > 0 and abs(want - today) > 1e-4  # some token dropped, and the rule changes the objective
    assert stats.objective == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(model.table.grad.double(), -grad, rtol=1e-4, atol=1e-6)
    unchanged, none = without_rejected_tokens(model, batches(sampler_table=sampler), PolicyLoss(
        max_new_tokens=MAX_NEW_TOKENS, **options), DEVICE_BATCH_SIZE, "cpu", nullcontext())  # today's rule: as they are
    assert none == 0 and all(torch.equal(a.targets, b.targets) for a, b in zip(unchanged, batches(sampler_table=sampler)))
