"""Work that cannot change the gradient is skipped: zero-advantage rows are not run, and each question's
prompt goes through the model once. The gradient must equal the plain computation (every row, every
prompt recomputed), on nanochat checkpoints of three generations (smear carries state across the
prompt/completion boundary)."""

from contextlib import nullcontext

import pytest
import torch

from nanochat.checkpoint_manager import build_model
from nanochat.rl import accumulate_policy_gradient, make_question_batch
from helpers import generation_reference, install_generation

PAD = 511


def question(prompt, rewards, lengths, seed):
    """A question whose samples are random completions of the given lengths; every third token of a row
    is marked forced (mask 0), as calculator output is."""
    gen = torch.Generator().manual_seed(seed)
    completions = []
    for n in lengths:
        tokens = torch.randint(0, 500, (n,), generator=gen).tolist()
        completions.append((tokens, [0 if i % 3 == 2 else 1 for i in range(n)]))
    return make_question_batch(prompt, completions, rewards, PAD)


def gradients(model, batches, device_batch_size, **kwargs):
    model.zero_grad(set_to_none=True)
    stats = accumulate_policy_gradient(model, batches, device_batch_size, examples_per_rank=len(batches),
                                       device="cpu", autocast=nullcontext(), **kwargs)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads, stats


def relative_errors(got, want):
    return {n: ((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-30)).item() for n in want}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in ("jan2026", "ve", "smear"):
        base = tmp_path_factory.mktemp(name)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NANOCHAT_BASE_DIR", str(base))  # where build_model finds the tokenizer
            out[name], _, _ = build_model(str(install_generation(base, name)), 5, "cpu", "train")
    return out


@pytest.mark.parametrize("name", ["jan2026", "ve", "smear"])
@pytest.mark.parametrize("device_batch_size", [1, 2, 4])
def test_skipping_and_prompt_sharing_leave_the_gradient_unchanged(models, name, device_batch_size):
    """Mixed advantages, a question whose samples all got the same reward (no gradient at all), rows of
    different lengths with forced tokens; passes of 1 (a single-row pass), 2 and 4 rows; and, after an
    out-of-memory, one row per forward.

    fp32: the whole gradient within 1e-6 of the plain one, relative to its norm. Parameters that sum
    contributions of every position (per-layer scalars, gates), whose advantages cancel, reach ~1e-5 of
    their own norm from fp32 rounding alone (the block matrices stay < 3e-7); in fp64 every parameter
    agrees to 1e-10."""
    prompts = [p for p in generation_reference(name)["greedy_prompts"]]  # 64 and 225 tokens
    batches = [question(prompts[0], [1, 0, 0, 1], [5, 9, 1, 7], seed=1),
               question(prompts[1][:40], [0, 0, 0, 0], [3, 4, 6, 2], seed=2),   # no signal: nothing to train
               question(prompts[0][:20], [1, 0, 0.5, 0.5], [12, 3, 8, 8], seed=3)]  # rows 2, 3: advantage 0
    for dtype in (torch.float32, torch.float64):
        model = models[name].to(dtype)
        plain, plain_stats = gradients(model, batches, device_batch_size, share_prompt=False, skip_zero_advantage=False)
        assert plain_stats.rows_trained == 12
        for micro in (None, 1):
            fast, stats = gradients(model, batches, device_batch_size, micro_batch_rows=micro)
            assert stats.rows_trained == 6 and stats.rows_total == 12  # the non-zero-advantage rows, exactly
            assert abs(stats.objective - plain_stats.objective) <= 1e-6 * abs(plain_stats.objective)
            errors = relative_errors(fast, plain)
            if dtype == torch.float64:
                assert max(errors.values()) <= 1e-10, errors
            else:
                total = torch.cat([(fast[n] - plain[n]).flatten() for n in plain]).norm()
                assert total <= 1e-6 * torch.cat([g.flatten() for g in plain.values()]).norm()
            assert sum(g.abs().sum() for g in fast.values()) > 0
    models[name].float()


def test_a_rank_with_nothing_to_train_has_zero_gradients(models):
    """Every question of this rank had no signal: no forward at all, but every parameter gets a zero
    gradient (the distributed optimizers reduce every parameter's gradient on every rank)."""
    model = models["smear"]
    batches = [question([1, 2, 3], [1, 1], [3, 4], seed=5), question([4, 5], [0, 0], [2, 2], seed=6)]
    grads, stats = gradients(model, batches, device_batch_size=2)
    assert stats.rows_trained == 0 and stats.objective == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


@pytest.mark.parametrize("name", ["jan2026", "smear"])
def test_shared_prefix_forward_equals_the_whole_sequence(models, name):
    """hidden_states_shared_prefix gives each row what hidden_states gives on prompt + row."""
    model = models[name]
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 512, (1, 150), generator=gen)  # past the short window (128)
    rows = torch.randint(0, 512, (3, 40), generator=gen)
    with torch.no_grad():
        prefix_hidden, rows_hidden = model.hidden_states_shared_prefix(prompt, rows)
        whole = model.hidden_states(torch.cat([prompt.expand(3, -1), rows], dim=1))
    torch.testing.assert_close(prefix_hidden.expand(3, -1, -1), whole[:, :150], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows_hidden, whole[:, 150:], atol=1e-5, rtol=1e-5)
