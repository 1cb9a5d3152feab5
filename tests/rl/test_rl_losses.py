"""--loss=gspo and --loss=cispo against the fp64 reference of tests/rl/test_rl_reference.py (written from the papers'
formulas): the objective and gradient of a PPO epoch after the first, with rows skipped (a question without signal),
each loss's own clip band, and the normalizations, the KL penalty and the rollout corrections they combine with.
The first epoch is on-policy (every ratio 1), where both losses' gradients are the policy gradient's."""

from contextlib import nullcontext

import pytest
import torch
from test_rl_reference import (DEVICE_BATCH_SIZE, MAX_NEW_TOKENS, QUESTIONS, VOCAB, batches, reference_gradient,
                               sampler_table, table_model)

from nanochat.rl.config import RLConfig
from nanochat.rl.objective import LOSS_CLIPS, PolicyLoss
from nanochat.rl.policy_gradient import accumulate_policy_gradient
from nanochat.rl.run import policy_loss_of


def moved(scale):
    """The policy that sampled (table_model(0)) and the one a later epoch runs, moved by noise of `scale`."""
    old, new = table_model(0), table_model(0)
    with torch.no_grad():
        new.table.add_(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(5)) * scale)
    return old, new


CASES = {
    # GSPO's band is 3e-4/4e-4 around a geometric mean: a small move leaves some rows inside it, some outside
    "gspo, sequence (the paper's mean of sequences)": (dict(loss="gspo", loss_norm="sequence"), 0.0004),
    "gspo, pass (nanochat), kl": (dict(loss="gspo", kl_coef=0.3), 0.0004),
    "gspo, token, sequence-mask": (dict(loss="gspo", loss_norm="token", rollout_correction="sequence-mask",
                                        correction_cap=1.5), 0.0004),
    "cispo, token (the paper's)": (dict(loss="cispo", loss_norm="token"), 0.4),
    "cispo, pass, truncated masked": (dict(loss="cispo", mask_truncated=True), 0.4),
    "cispo, sequence, token-tis, kl": (dict(loss="cispo", loss_norm="sequence", rollout_correction="token-tis",
                                            correction_cap=1.5, kl_coef=0.3), 0.4),
}


@pytest.mark.parametrize("options, scale", CASES.values(), ids=CASES.keys())
def test_later_epoch_equals_the_reference(options, scale):
    old, new = moved(scale)
    reference, sampler = table_model(1), sampler_table()
    clip_low, clip_high = LOSS_CLIPS[options["loss"]]
    loss = PolicyLoss(max_new_tokens=MAX_NEW_TOKENS, clip_low=clip_low, clip_high=clip_high, **options)
    run = lambda model, first=None: accumulate_policy_gradient(  # noqa: E731
        model, batches(sampler_table=sampler), DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu", nullcontext(), loss=loss,
        reference=reference, first_epoch=first)
    stats = run(new, run(old))
    want, grad, clipped = reference_gradient(new, old_table=old.table.detach().double(), clip_low=clip_low,
                                             clip_high=clip_high, ref_table=reference.table.detach().double(),
                                             sampler_table=sampler.double(), **options)
    if not options.get("kl_coef"):  # the question without signal is skipped (the KL penalty trains every row)
        assert stats.rows_trained < stats.rows_total
    assert stats.objective == pytest.approx(want, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(new.table.grad.double(), -grad, rtol=1e-4, atol=1e-6)
    if options.get("rollout_correction", "none") == "none":  # else the reference counts corrected tokens
        assert 0 < clipped < stats.tokens and stats.clip_fraction == pytest.approx(clipped / stats.tokens)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_at_ratio_one_the_gradient_is_the_policy_gradient(name):
    """A later epoch on the policy that sampled (every ratio exactly 1, no clip active): GSPO's row term s_i A_i has the
    gradient A_i * mean of the row's grad logp, given to each of its tokens; CISPO's weight is 1: both are the policy
    gradient, PPO's term's at ratio 1, to rounding. Guards the later-epoch branch (the first epoch runs pg's term
    whatever the loss)."""
    grads = []
    for loss in ("pg", name):
        model = table_model(0)
        policy_loss = PolicyLoss(loss=loss, clip_low=LOSS_CLIPS[loss][0], clip_high=LOSS_CLIPS[loss][1])
        run = lambda first=None: accumulate_policy_gradient(  # noqa: E731
            model, batches(), DEVICE_BATCH_SIZE, len(QUESTIONS), "cpu", nullcontext(), loss=policy_loss, first_epoch=first)
        first = run()
        model.zero_grad()
        stats = run(first)
        assert stats.clip_fraction == 0
        grads.append(model.table.grad.clone())
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_each_loss_has_its_own_clip_defaults_and_flags_override_them():
    for loss, (low, high) in LOSS_CLIPS.items():
        got = RLConfig(loss=loss, ppo_epochs=2)
        assert (got.clip_low, got.clip_high) == (low, high)
        assert policy_loss_of(got).loss == loss
    got = RLConfig(loss="gspo", ppo_epochs=2, clip_high=0.001)
    assert (got.clip_low, got.clip_high) == (3e-4, 0.001)
    assert (RLConfig().clip_low, RLConfig().clip_high) == (0.2, 0.2)  # nanochat's run: PPO's defaults, never used


# each loss's clip band where --clip-low/--clip-high are not given, written from docs/flags.md and its sources, not
# read from LOSS_CLIPS: pg PPO's 0.2/0.2 (Schulman et al. 2017); gspo 3e-4/4e-4 (the GSPO paper, v2 section 5.1);
# cispo no floor (clip-low 1: MiniMax-M1 bounds the weight above only) and DAPO's clip-higher 0.28 above
DOCUMENTED_CLIPS = {"pg": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}


@pytest.mark.parametrize("loss", DOCUMENTED_CLIPS)
def test_the_run_s_policy_loss_clips_at_the_documented_band_or_the_user_s(loss):
    """The PolicyLoss a run trains with (run.policy_loss_of of its config) carries its loss's documented band, and a
    user's --clip-low/--clip-high in its place. Guards two bugs that passed the config-level test: policy_loss_of not
    passing the clips on (PolicyLoss's own 0.2/0.2 then clipped gspo and cispo, whatever the flags said), and cispo's
    default band changed to 0.2/0.28."""
    policy_loss = policy_loss_of(RLConfig(loss=loss, ppo_epochs=2))
    assert (policy_loss.loss, policy_loss.clip_low, policy_loss.clip_high) == (loss, *DOCUMENTED_CLIPS[loss])
    policy_loss = policy_loss_of(RLConfig(loss=loss, ppo_epochs=2, clip_low=0.05, clip_high=0.4))
    assert (policy_loss.clip_low, policy_loss.clip_high) == (0.05, 0.4)
