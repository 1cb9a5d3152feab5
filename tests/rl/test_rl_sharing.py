"""Work that cannot change the gradient is skipped: zero-advantage rows are not run, and each question's
prompt goes through the model once. The gradient must equal the plain computation (every row, every
prompt recomputed), on nanochat checkpoints of three generations (smear carries state across the
prompt/completion boundary)."""

from contextlib import nullcontext

import pytest
import torch
from helpers import generation_reference, install_generation

from nanochat.checkpoints.loading import build_model
from nanochat.rl.advantages import make_question_batch
from nanochat.rl.objective import pass_denominators
from nanochat.rl.policy_gradient import accumulate_policy_gradient

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


def term_sizes(model, batches):
    """The sizes of the terms that the objective and its gradient sum: per question, (R, T) float64 tensors of
    |logp_t| and of |grad logp_t| (the norm over every parameter) for each sampled token t of the rows with a
    non-zero advantage (0 elsewhere: those rows add nothing), each from a forward and backward of its own."""
    logps, grad_norms = [], []
    for batch in batches:
        logp = torch.zeros(batch.targets.shape, dtype=torch.float64)
        grad_norm = torch.zeros(batch.targets.shape, dtype=torch.float64)
        for r, t in (batch.targets >= 0).nonzero().tolist():
            if batch.advantages[r] == 0:
                continue
            model.zero_grad(set_to_none=True)
            hidden = model.hidden_states(batch.inputs[r:r + 1, :t + 1])[0, t]
            term = torch.log_softmax(model.logits(hidden), dim=-1)[batch.targets[r, t]]
            term.backward()
            logp[r, t] = term.item()
            grad_norm[r, t] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
        logps.append(logp)
        grad_norms.append(grad_norm)
    model.zero_grad(set_to_none=True)
    return logps, grad_norms


def mixed_batches(name):
    """Mixed advantages, a question whose samples all got the same reward (no gradient at all), rows of
    different lengths with forced tokens."""
    prompts = generation_reference(name)["greedy_prompts"]  # 64 and 225 tokens
    return [question(prompts[0], [1, 0, 0, 1], [5, 9, 1, 7], seed=1),
            question(prompts[1][:40], [0, 0, 0, 0], [3, 4, 6, 2], seed=2),   # no signal: nothing to train
            question(prompts[0][:20], [1, 0, 0.5, 0.5], [12, 3, 8, 8], seed=3)]  # rows 2, 3: advantage 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in ("jan2026", "ve", "smear"):
        base = tmp_path_factory.mktemp(name)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NANOCHAT_BASE_DIR", str(base))  # where build_model finds the tokenizer
            out[name], _, _ = build_model(str(install_generation(base, name)), 5, "cpu", "train")
    return out


@pytest.fixture(scope="module")
def mixed(models):
    """name -> (mixed_batches(name), their term_sizes in fp64)."""
    out = {}
    for name, model in models.items():
        batches = mixed_batches(name)
        out[name] = batches, term_sizes(model.double(), batches)
        model.float()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jan2026", "ve", "smear"])
@pytest.mark.parametrize("device_batch_size", [1, 2, 4])
def test_skipping_and_prompt_sharing_leave_the_gradient_unchanged(models, mixed, name, device_batch_size):
    """mixed_batches in passes of 1 (a single-row pass), 2 and 4 rows; and, after an out-of-memory, one row
    per forward. fp64: every parameter's gradient within 1e-10 of its own norm (GPT.logits casts each token's
    logits to float32 alike in both paths, from hidden states that agree to ~1e-16). fp32: the objective and the
    gradient within what rounding can make of sums of their size (below), which the CPU's kernels order."""
    batches, (logps, grad_norms) = mixed[name]
    # Both paths add the same terms x_t = w_t * logp_t (w = advantage / denominator of t's row) and their
    # gradients, in groupings that differ between the paths and between CPU kinds (AVX2, AVX-512, AMX
    # kernels). A sum of at most n terms (n: every sampled token; the zero-advantage rows' terms are exactly 0)
    # errs by at most (n - 1) u sum |x_t| in any order, u the unit roundoff (Higham, Accuracy and Stability
    # of Numerical Algorithms, eq. 4.4; norm-wise for the gradient, with |grad x_t| for |x_t|), and each term
    # brings its own forward or backward rounding, a few u of it (<= 3 u measured on logp): each path is
    # within (n + 2) u sum |x_t| of the exact sum, the two within twice that. The sizes, not the results, set
    # the scale: a question's advantages sum to 0, so with one-row passes the objective is ~1/70 of
    # sum |x_t|, and a bound relative to the objective failed by a few ulps of sum |x_t| on some CPUs. The
    # bound is ~3e-5 of the gradient's norm (measured errors stay under 1% of it), while a skipped row left out
    # of its pass's denominator, a wrong prompt position or smear lost at the prompt's end moves it by 6e-2 to 1.
    u = torch.finfo(torch.float32).eps / 2
    n = sum(int((b.targets >= 0).sum()) for b in batches)
    weights = [(b.advantages.double() / pass_denominators(b.targets, device_batch_size, len(batches))).abs()[:, None]
               for b in batches]  # (R, 1) |w| of each row
    objective_bound = 2 * (n + 2) * u * sum((w * logp.abs()).sum() for w, logp in zip(weights, logps)).item()
    gradient_bound = 2 * (n + 2) * u * sum((w * g).sum() for w, g in zip(weights, grad_norms)).item()
    for dtype in (torch.float32, torch.float64):
        model = models[name].to(dtype)
        plain, plain_stats = gradients(model, batches, device_batch_size, share_prompt=False, skip_zero_advantage=False)
        assert plain_stats.rows_trained == 12
        for micro in (None, 1):
            fast, stats = gradients(model, batches, device_batch_size, micro_batch_rows=micro)
            assert stats.rows_trained == 6 and stats.rows_total == 12  # the non-zero-advantage rows, exactly
            # fp32 in the fp64 run too: GPT.logits returns float32 logits, so log_softmax and this sum are float32
            assert abs(stats.objective - plain_stats.objective) <= objective_bound
            errors = relative_errors(fast, plain)
            if dtype == torch.float64:
                assert max(errors.values()) <= 1e-10, errors
            else:
                total = torch.cat([(fast[k] - plain[k]).flatten() for k in plain]).norm().item()
                assert total <= gradient_bound, (total, gradient_bound, errors)
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
