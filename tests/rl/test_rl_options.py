"""The algorithm options of the RL objective (--loss-norm, --advantage-std, --mask-truncated, --ppo-epochs with
--clip-low/--clip-high, --kl-coef): a regression guard that the defaults still compute what the loop before the
options computed, hand-computed numbers on tiny batches, 2 gloo ranks against 1 process, chat_rl's validation and
resume, and compare_runs. Each option against a reference written from its formula alone: test_rl_reference.py."""

import copy
import json
import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import TINY_RL_FLAGS, TableModel, random_model, tiny_config
from rl_options_worker import CASES, questions, run_case

from nanochat.cli import run_main
from nanochat.rl.advantages import advantages_from_rewards, make_question_batch
from nanochat.rl.objective import (PolicyLoss, clipped_surrogate, k3_kl, pass_denominators, step_counts,
                                   token_logprobs_and_entropy)
from nanochat.rl.policy_gradient import _chunk_hidden, _prompt_offset, _trained_rows, accumulate_policy_gradient
from scripts import chat_rl, compare_runs, rl_variants

LN2, LN8 = math.log(2), math.log(8)


def row_weights(targets, advantages, device_batch_size, examples_per_rank):
    """Each row's weight in nanochat's objective: the objective is sum over rows r and their valid positions
    t of logp[r, t] * w[r], with w[r] = adv[r] / (valid targets of r's pass * passes * examples_per_rank),
    which is pass_objective (tests/support/oracles.py) summed over the question's passes. targets: (R, T);
    advantages: (R,) -> (R,)."""
    return advantages / pass_denominators(targets, device_batch_size, examples_per_rank).to(advantages.dtype)


def row_hidden_states(model, inputs, prompt_length, share_prompt):
    """Hidden states (B, T', C) of the positions that can carry a target, and the offset T - T' they start at, for
    rows (B, T) of one question. With share_prompt the prompt (the first prompt_length tokens, the same in every
    row) goes through the model once and each row's tokens after it attend to it; its last position (the one
    predicting the first completion token) is the only prompt position kept."""
    P = prompt_length
    offset = _prompt_offset(P, inputs.size(1), share_prompt)
    if offset == 0:
        return model.hidden_states(inputs), 0
    return _chunk_hidden(model, inputs[:, P:], inputs[:1, :P], None, None), offset


def frozen_pre_options_loop(model, batches, device_batch_size, examples_per_rank, micro_batch_rows=None,
                            share_prompt=True, skip_zero_advantage=True):
    """The policy-gradient loop as it was before the algorithm options, frozen here: a regression guard, not a
    reference. It is built from nanochat.rl's own helpers (pass_denominators, _trained_rows, _chunk_hidden,
    token_logprobs_and_entropy), so it catches the options changing what the defaults compute (same rows, same
    chunks, same operations in the same order: bit for bit), not a mistake those helpers share. The objective
    checked against formulas written independently of nanochat.rl is in test_rl_reference.py."""
    micro = micro_batch_rows or device_batch_size
    total = 0.0
    for batch in batches:
        weights = row_weights(batch.targets, batch.advantages, device_batch_size, examples_per_rank)
        rows = _trained_rows(batch.targets, weights) if skip_zero_advantage else list(range(batch.targets.size(0)))
        for lo in range(0, len(rows), micro):
            chunk = torch.tensor(rows[lo:lo + micro])
            inputs, targets = batch.inputs[chunk], batch.targets[chunk]
            hidden, offset = row_hidden_states(model, inputs, batch.prompt_length, share_prompt)
            targets = targets[:, offset:]
            valid = targets >= 0
            logp, _ = token_logprobs_and_entropy(model.logits(hidden[valid]), targets[valid])
            token_weights = weights[chunk][:, None].expand_as(targets)[valid]
            objective = (logp * token_weights.to(logp.dtype)).sum()
            (-objective).backward()
            total += objective.item()
    return total


def tiny_gpt():
    config = tiny_config(sequence_len=64, vocab_size=64, n_head=2, n_kv_head=1, n_embd=32, window_pattern="SL")
    return random_model(config, seed=3, noise=0.2)


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make_model", [lambda: TableModel(64), tiny_gpt], ids=["table", "gpt"])
@pytest.mark.parametrize("variant", [{}, {"micro_batch_rows": 1}, {"share_prompt": False, "skip_zero_advantage": False}])
def test_defaults_reproduce_the_frozen_pre_options_loop_bit_for_bit(make_model, variant):
    """Regression guard: every option at its default (also spelled out as a PolicyLoss, and with truncated rows
    recorded but not masked) gives exactly the gradient of the loop that had no options."""
    batches = questions()
    model = make_model()
    reference = copy.deepcopy(model)
    want_objective = frozen_pre_options_loop(reference, batches, 2, 4, **variant)
    for loss in (None, PolicyLoss(loss_norm="pass", max_new_tokens=6, mask_truncated=False, clip_low=0.2,
                                  clip_high=0.2, kl_coef=0.0)):
        model.zero_grad(set_to_none=True)
        stats = accumulate_policy_gradient(model, batches, 2, 4, "cpu", nullcontext(), loss=loss, **variant)
        assert stats.objective == want_objective
        for name, grad in grads_of(model).items():
            assert torch.equal(grad, dict(reference.named_parameters())[name].grad), name


def test_advantages_scaled_by_std_and_a_zero_std_question_stays_zero():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    std = math.sqrt(0.25 * 0.75)  # population std of one 1 among four
    got = advantages_from_rewards(rewards, scale_by_std=True)
    assert torch.allclose(got, torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-4))
    assert advantages_from_rewards(rewards).tolist() == [0.75, -0.25, -0.25, -0.25]  # default: no scaling
    for same in ([1.0, 1.0, 1.0], [0.0, 0.0], [1.0]):
        batch = make_question_batch([1], [([2], [1])] * len(same), same, 0, scale_by_std=True)
        assert batch.advantages.tolist() == [0.0] * len(same)  # no NaN from 0 / 0


def test_clipped_surrogate_for_both_signs_of_the_advantage():
    """rho = 2 and 0.5 with A = +-0.5, clip 0.2/0.28: the clipped term wins (and blocks the gradient) for A > 0
    above 1 + clip_high and for A < 0 below 1 - clip_low; elsewhere the unclipped rho * A."""
    logp = torch.log(torch.tensor([0.25, 1 / 16, 0.25, 1 / 16]))
    old = torch.log(torch.full((4,), 1 / 8))
    adv = torch.tensor([0.5, 0.5, -0.5, -0.5])
    surrogate, ratio, clipped = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    assert torch.allclose(ratio, torch.tensor([2.0, 0.5, 2.0, 0.5]))
    assert torch.allclose(surrogate, torch.tensor([1.28 * 0.5, 0.5 * 0.5, 2.0 * -0.5, 0.8 * -0.5]))
    assert clipped.tolist() == [True, False, False, True]


def ppo_batch():
    # prompt [1]; row 0 samples 2 then 3, row 1 samples 4 then 5; rewards 1, 0 -> advantages +0.5, -0.5
    return make_question_batch([1], [([2, 3], [1, 1]), ([4, 5], [1, 1])], [1.0, 0.0], 0)


def table_with(probabilities, vocab=8):
    """A TableModel whose row i gives token t the probability p for every (i, t, p) listed (one p per row),
    the other tokens equal logits 0."""
    model = TableModel(vocab)
    with torch.no_grad():
        model.table.zero_()
        for row, tokens, p in probabilities:
            # k tokens with logit x and vocab - k with 0: p = e^x / (k e^x + vocab - k)
            model.table[row, tokens] = math.log(p * (vocab - len(tokens)) / (1 - len(tokens) * p))
    return model


def expected_table_grad(model, batch, token_grads):
    """The gradient of -objective on a TableModel when d objective / d logp of each sampled token (row, position)
    is token_grads[(row, position)]: row `input` of the table gets -g * (onehot(target) - softmax)."""
    grad = torch.zeros_like(model.table)
    for (r, t), g in token_grads.items():
        i, target = batch.inputs[r, t], batch.targets[r, t]
        p = torch.softmax(model.table[i].detach(), -1)
        grad[i] -= g * (torch.nn.functional.one_hot(target, p.numel()).float() - p)
    return grad


@pytest.mark.parametrize("clip_high", [0.2, 0.28])
def test_second_ppo_epoch_hand_computed(clip_high):
    """Old policy uniform (p = 1/8); after the 'update' p = 1/16 for the first tokens (rho = 0.5) and 1/4 for the
    second (rho = 2). pass norm: D = 4 valid tokens. Tokens: (A=+0.5, rho=0.5) unclipped, (+0.5, 2) clipped,
    (-0.5, 0.5) clipped, (-0.5, 2) unclipped."""
    batch = ppo_batch()
    loss = PolicyLoss(clip_low=0.2, clip_high=clip_high)
    old = table_with([])
    first = accumulate_policy_gradient(old, [batch], 2, 1, "cpu", nullcontext(), loss=loss)
    assert torch.allclose(first.old_logprobs[0], torch.full((2, 2), -LN8))
    assert first.clip_fraction is None and first.approx_kl is None
    new = table_with([(1, [2, 4], 1 / 16), (2, [3], 1 / 4), (4, [5], 1 / 4)])
    stats = accumulate_policy_gradient(new, [batch], 2, 1, "cpu", nullcontext(), loss=loss, first_epoch=first)
    assert math.isclose(stats.objective, (0.5 * 0.5 + (1 + clip_high) * 0.5 - 0.8 * 0.5 - 2 * 0.5) / 4, rel_tol=1e-6)
    assert stats.clip_fraction == 0.5
    assert math.isclose(stats.approx_kl, ((1 - LN2) * 2 + (-0.5 + LN2) * 2) / 4, rel_tol=1e-6)  # mean (rho-1) - log rho
    # d objective / d logp = A * rho / D where unclipped, 0 where clipped
    want = expected_table_grad(new, batch, {(0, 0): 0.5 * 0.5 / 4, (0, 1): 0.0, (1, 0): 0.0, (1, 1): -0.5 * 2 / 4})
    assert torch.allclose(new.table.grad, want, atol=1e-7)


def test_kl_penalty_is_zero_with_zero_gradient_when_the_policy_is_the_reference():
    """Zero advantages and the policy equal to the reference: nothing to learn. The KL penalty still runs every
    row (row skipping is off), and contributes exactly 0 and a zero gradient."""
    torch.manual_seed(0)
    model = TableModel(8)
    batch = make_question_batch([1], [([2, 3], [1, 1]), ([4, 5], [1, 1])], [1.0, 1.0], 0)
    stats = accumulate_policy_gradient(model, [batch], 2, 1, "cpu", nullcontext(), loss=PolicyLoss(kl_coef=0.5),
                                       reference=copy.deepcopy(model))
    assert stats.rows_trained == stats.rows_total == 2
    assert stats.kl_ref == 0.0 and stats.objective == 0.0
    assert torch.equal(model.table.grad, torch.zeros_like(model.table))


def test_kl_penalty_hand_computed_and_row_skipping_off():
    """Policy p = 1/4 on every sampled token, reference uniform (1/8): ref - logp = -ln 2 and
    k3 = 1/2 + ln 2 - 1 per token; with zero advantages the objective is -kl_coef * mean k3 (pass norm, D = 4),
    and d objective / d logp = -kl_coef * (1 - exp(ref - logp)) / D = -kl_coef * 0.5 / 4."""
    batch = make_question_batch([1], [([2, 3], [1, 1]), ([4, 5], [1, 1])], [0.0, 0.0], 0)
    policy = table_with([(1, [2, 4], 1 / 4), (2, [3], 1 / 4), (4, [5], 1 / 4)])
    skipped = accumulate_policy_gradient(policy, [batch], 2, 1, "cpu", nullcontext())
    assert skipped.rows_trained == 0  # without the penalty zero-advantage rows are skipped
    policy.table.grad = None
    beta, k3 = 0.1, 0.5 + LN2 - 1
    stats = accumulate_policy_gradient(policy, [batch], 2, 1, "cpu", nullcontext(), loss=PolicyLoss(kl_coef=beta),
                                       reference=table_with([]))
    assert stats.rows_trained == stats.rows_total == 2
    assert math.isclose(stats.kl_ref, k3, rel_tol=1e-6)
    assert math.isclose(stats.objective, -beta * k3, rel_tol=1e-6)
    g = -beta * 0.5 / 4
    want = expected_table_grad(policy, batch, {(r, t): g for r in range(2) for t in range(2)})
    assert torch.allclose(policy.table.grad, want, atol=1e-7)
    assert torch.allclose(k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0 - LN2])), torch.tensor([k3]))


def truncated_batch():
    # 4 rows, 2 passes of 2; row 1 (3 tokens, the only user of inputs 6 and 7) was cut at the length cap
    return make_question_batch([1], [([2, 3], [1, 1]), ([6, 7, 6], [1, 1, 1]), ([4], [1]), ([5, 3], [1, 1])],
                               [1.0, 0.0, 1.0, 0.0], 0, truncated=[False, True, False, False])


@pytest.mark.parametrize("loss_norm, want", [
    # uniform policy: every logp = -ln 8; A = +0.5, -0.5, +0.5, -0.5; 2 passes (P = 2), 1 question
    ("pass", -LN8 * (0.5 * 2 / (2 * 2) + (0.5 * 1 - 0.5 * 2) / (3 * 2))),  # pass 0 holds row 0's 2 tokens only
    ("token", -LN8 * (0.5 * 2 + 0.5 * 1 - 0.5 * 2) / 5),                  # 5 tokens outside row 1
    ("sequence", -LN8 * (0.5 + 0.5 - 0.5) / 3),                           # 3 sequences, each its token mean
    ("constant", -LN8 * (0.5 * 2 + 0.5 * 1 - 0.5 * 2) / (3 * 10)),       # 3 rows * max_new_tokens 10
])
def test_truncated_rows_are_masked_and_count_in_no_denominator(loss_norm, want):
    batch = truncated_batch()
    model = table_with([])
    stats = accumulate_policy_gradient(model, [batch], 2, 1, "cpu", nullcontext(),
                                       loss=PolicyLoss(loss_norm=loss_norm, max_new_tokens=10, mask_truncated=True))
    assert math.isclose(stats.objective, want, rel_tol=1e-6)
    assert stats.rows_trained == 3 and stats.tokens == 5
    with_kl = accumulate_policy_gradient(table_with([]), [batch], 2, 1, "cpu", nullcontext(), reference=table_with([]),
                                         loss=PolicyLoss(loss_norm=loss_norm, max_new_tokens=10, mask_truncated=True,
                                                         kl_coef=0.1))
    assert with_kl.rows_trained == 3 and with_kl.objective == stats.objective  # KL 0: the policy is the reference
    assert model.table.grad[6].abs().sum() == 0 and model.table.grad[7].abs().sum() == 0
    counts = step_counts([batch], True, "cpu")
    assert (counts.tokens, counts.sequences, counts.questions, counts.world_size) == (5, 3, 1, 1)
    assert (step_counts([batch], False, "cpu").tokens, step_counts([batch], False, "cpu").sequences) == (8, 4)


def test_every_normalization_on_two_gloo_ranks_equals_one_process(tmp_path):
    """Each rank holds half the questions (different token counts); the optimizers average the ranks'
    gradients, so every normalization's step-level denominator must be divided by the world size. Both the
    on-policy epoch and a clipped second epoch (after the same SGD step) must match one process holding every
    question, for each normalization, plain and with truncated rows masked plus the KL penalty, and with a masking
    rollout correction whose dropped tokens count in the denominators or not (--rejected-tokens: the filtering
    comes before the step's counts are summed over the ranks)."""
    out = tmp_path / "two_ranks.pt"
    run_ranks(lambda rank: [str(Path(__file__).parents[1] / "support" / "rl_options_worker.py"), str(out)], world_size=2, timeout=120)
    two = torch.load(out, weights_only=True)
    batches = questions()
    clipped, first_epochs = [], {}
    for i, case in enumerate(CASES):
        grad1, grad2, second = run_case(case, batches, len(batches), lambda g: g)
        assert grad1.abs().sum() > 0 and grad2.abs().sum() > 0
        torch.testing.assert_close(two[i][0], grad1, rtol=1e-5, atol=1e-8, msg=f"first epoch, {case}")
        torch.testing.assert_close(two[i][1], grad2, rtol=1e-5, atol=1e-8, msg=f"second epoch, {case}")
        clipped.append(second.clip_fraction)
        first_epochs[tuple(sorted(case.items()))] = grad1
    assert all(0 < c < 1 for c in clipped), clipped  # the second epoch really exercised the clip
    for case in CASES:  # --rejected-tokens: the peers' rule changes the gradient (some token was dropped)
        if case.get("rejected_in_denominator") is False:
            counted = first_epochs[tuple(sorted({**case, "rejected_in_denominator": True}.items()))]
            assert (first_epochs[tuple(sorted(case.items()))] - counted).abs().max() > 1e-6, case


@pytest.mark.parametrize("flags, message", [
    (["--ppo-epochs=0"], "--ppo-epochs must be >= 1"),
    (["--clip-low=1.5"], "--clip-low must be in [0, 1]"),
    (["--clip-low=-0.1"], "--clip-low must be in [0, 1]"),
    (["--loss=grpo"], "--loss must be pg, gspo, cispo, got 'grpo'"),
    (["--loss=gspo"], "--loss=gspo changes only the PPO epochs after the first"),
    (["--loss=gspo", "--ppo-epochs=2", "--rollout-correction=token-tis"], "use --rollout-correction=sequence-mask"),
    (["--clip-high=-0.2"], "--clip-high must be >= 0"),
    (["--kl-coef=-0.01"], "--kl-coef must be >= 0"),
    (["--loss-norm=tokens"], "--loss-norm must be pass, token, sequence, constant, got 'tokens'"),
    # on-policy distillation's (a teacher of another tokenizer, refused once it is found: bad_input_table)
    (["--teacher=sft"], "--teacher=sft is scored with --distill-coef > 0"),
    (["--distill-coef=0.5"], "name it with --teacher=SOURCE[:MODEL_TAG[:STEP]]"),
    (["--teacher=sft:d2:x", "--distill-coef=1"], "--teacher must be SOURCE[:MODEL_TAG[:STEP]]"),
    (["--teacher=pretrain", "--distill-coef=1"], "--teacher must be SOURCE[:MODEL_TAG[:STEP]]"),
    (["--distill-coef=-1"], "--distill-coef must be >= 0"),
    (["--reward-coef=0"], "--reward-coef=0 without --distill-coef"),
    (["--teacher=sft", "--distill-coef=1", "--loss=gspo", "--ppo-epochs=2"], "use --loss=pg or cispo with --teacher"),
])
def test_bad_option_values_are_refused_in_one_line(flags, message, tmp_path, monkeypatch, capsys):
    """Refused before anything loads: the base dir is empty."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        run_main(chat_rl.main, TINY_RL_FLAGS + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


OPTION_FLAGS = ["--loss-norm=token", "--clip-high=0.28", "--ppo-epochs=2", "--kl-coef=0.01", "--advantage-std",
                "--mask-truncated"]
OPTIONS = {"loss_norm": "token", "clip_high": 0.28, "ppo_epochs": 2, "kl_coef": 0.01, "advantage_std": True,
           "mask_truncated": True}


@pytest.mark.slow
def test_options_run_checkpoint_and_resume(sft, base_dir, capsys):
    """Every option at once: the run logs the PPO and KL diagnostics and records the flags, the starting
    checkpoint and the final eval in its meta; --resume (with no option flags) restores the options, reloads the
    reference from the starting checkpoint, and ends with the weights of the uninterrupted run."""
    flags = TINY_RL_FLAGS + OPTION_FLAGS + ["--max-new-tokens=24", "--num-steps=3", "--save-every=1", "--eval-every=3",
                                            "--eval-examples=1"]
    chat_rl.main(flags)
    out = capsys.readouterr().out
    assert "Step 1/3 |" in out and "| PPO clipped: " in out and ", KL to the old policy " in out
    assert "| KL to the reference: " in out
    rl_dir = base_dir / "chatrl_checkpoints" / "d2"
    meta = json.loads((rl_dir / "meta_000002.json").read_text())
    assert {k: meta["user_config"][k] for k in OPTIONS} == OPTIONS
    assert meta["start_checkpoint"] == {"source": "sft", "model_tag": "d2", "step": 0}
    assert [s for s, _ in meta["eval_history"]] == [0, 3]  # the final eval is recorded with the last checkpoint
    assert all(k in meta["history"][-1] for k in ("clip_fraction", "approx_kl", "kl_ref", "trained_tokens"))
    uninterrupted = torch.load(rl_dir / "model_000002.pt", weights_only=True)

    (rl_dir / "model_000002.pt").unlink()
    chat_rl.main(["--resume=d2:1", "--device-type=cpu"])
    out = capsys.readouterr().out
    restored = next(line for line in out.splitlines()
                    if line.startswith("--resume: run d2 continues with its saved settings"))
    assert all(f"{k}={v}" in restored for k, v in OPTIONS.items())
    assert out.count("Loading model from") == 2 and "chatsft_checkpoints/d2 with step 0" in out  # the reference
    resumed_meta = json.loads((rl_dir / "meta_000002.json").read_text())
    assert {k: resumed_meta["user_config"][k] for k in OPTIONS} == OPTIONS
    resumed = torch.load(rl_dir / "model_000002.pt", weights_only=True)
    for k in uninterrupted:
        assert torch.equal(resumed[k], uninterrupted[k]), k


def fake_run(directory, loss_norm, rewards, pass1):
    directory.mkdir(parents=True)
    history = [{"step": s, "reward_mean": r, "completion_len_mean": 40.0 + s, "entropy": 0.5 - 0.01 * s}
               for s, r in enumerate(rewards)]
    meta = {"user_config": {"loss_norm": loss_norm, "run": str(directory), "num_steps": len(rewards)}, "history": history,
            "eval_history": [[s, {"pass@1": p, "pass@1_unbiased": p - 0.05}] for s, p in zip((0, len(rewards)), pass1)]}
    (directory / "meta_000003.json").write_text(json.dumps(meta))
    (directory / "model_000003.pt").write_bytes(b"")


def test_compare_runs_plots_and_tabulates(tmp_path, capsys):
    fake_run(tmp_path / "base", "pass", [0.5, 0.6, 0.55, 0.7], (0.4, 0.5))
    fake_run(tmp_path / "token", "token", [0.5, 0.65, 0.7, 0.75], (0.4, 0.6))
    png = tmp_path / "plots" / "cmp.png"
    compare_runs.main([str(tmp_path / "base"), str(tmp_path / "token"), f"--output={png}", "--smooth=2"])
    out = capsys.readouterr().out
    assert png.read_bytes().startswith(b"\x89PNG")
    rows = [line for line in out.splitlines() if line.startswith("| base") or line.startswith("| token")]
    assert len(rows) == 2
    assert "loss_norm=pass" in rows[0] and "0.5000 (step 4)" in rows[0] and "| 0.4500 |" in rows[0] and "run=" not in rows[0]
    assert "loss_norm=token" in rows[1] and "0.6000 (step 4)" in rows[1]
    with pytest.raises(SystemExit) as e:
        run_main(compare_runs.main, [str(tmp_path / "nope")])
    assert e.value.code == 2 and "is not a directory" in capsys.readouterr().err


def test_rl_variants_refuses_an_unknown_variant_before_running_anything(capsys):
    with pytest.raises(SystemExit) as e:
        run_main(rl_variants.main, ["--variants=default,dapo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown dapo" in err and "token_ppo" in err and err.count("\n") == 1
