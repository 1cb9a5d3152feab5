"""chat_rl flags that reach what they control: each test fails when its flag stops reaching the code.

--num-epochs (the step count), --top-k (the sampler), --memory-budget-gb (the engine's rollout rows), the lr and
weight-decay flags (the optimizers' param groups, after --init-lr-frac) and --recipe=2026-07 (run and resume).
Resuming on the same or another number of ranks: tests/checkpoints/test_resume_ranks.py."""

import argparse
import json
import math

import pytest
import torch
from helpers import TINY_RL_FLAGS, assert_same_weights, weights

from nanochat.engine.engine import Engine
from nanochat.errors import UserError
from nanochat.rl import run as rl_run
from nanochat.rl.plan import AUTO_TRAIN_ROWS, train_rows
from scripts import chat_rl

GSM8K_FLAGS = [f for f in TINY_RL_FLAGS if not f.startswith("--task")]  # the default task: the GSM8K fixture


def rl_dir(base_dir):
    return base_dir / "chatrl_checkpoints" / "d2"


def capture_runs(monkeypatch):
    """chat_rl.main sets the run up (model, optimizers, engine, step count) and hands it over instead of training."""
    runs = []
    monkeypatch.setattr(chat_rl, "train", lambda run, stop: runs.append(run))
    return runs


def record_rollouts(monkeypatch):
    """Every Engine.generate_many call as (its keyword arguments, its completions, the engine's largest batch)."""
    real, calls = Engine.generate_many, []

    def generate_many(self, prompts, **kwargs):
        results = real(self, prompts, **kwargs)
        calls.append((kwargs, results, self.last_stats.max_batch_rows))
        return results
    monkeypatch.setattr(Engine, "generate_many", generate_many)
    return calls


# ----------------------------------------------------------------------------- --num-epochs

@pytest.mark.parametrize("epochs, per_step, steps", [
    (1, 4, 3),   # the fixture's 12 train questions: 12 // 4 * 1
    (3, 4, 9),
    (2, 5, 4),   # 12 // 5 = 2 whole steps per epoch
])
def test_num_epochs_sets_the_step_count(epochs, per_step, steps, sft, base_dir, monkeypatch, capsys):
    runs = capture_runs(monkeypatch)
    chat_rl.main(GSM8K_FLAGS + [f"--num-epochs={epochs}", f"--examples-per-step={per_step}"])
    assert runs[0].num_steps == steps
    assert f"Calculated number of steps: {steps}" in capsys.readouterr().out


def test_num_epochs_run_takes_that_many_steps(sft, base_dir, capsys):
    chat_rl.main(GSM8K_FLAGS + ["--num-epochs=2", "--examples-per-step=8", "--num-samples=2", "--max-new-tokens=8"])
    out = capsys.readouterr().out
    assert [l.split(" |")[0] for l in out.splitlines() if "Average reward" in l] == ["Step 0/2", "Step 1/2"]
    meta = json.loads((rl_dir(base_dir) / "meta_000001.json").read_text())
    assert [r["step"] for r in meta["history"]] == [0, 1] and meta["user_config"]["num_epochs"] == 2


# ----------------------------------------------------------------------------- --top-k

def first_rollout_tokens(flags, monkeypatch):
    calls = record_rollouts(monkeypatch)
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--overwrite"] + flags)
    kwargs, results, _ = calls[0]
    return kwargs["top_k"], [[c.tokens for c in question] for question in results]


def test_top_k_one_samples_the_greedy_tokens(sft, base_dir, monkeypatch):
    """With --top-k=1 only the most likely token survives, so sampling at temperature 1 gives the greedy rollout;
    the default top-k of 50 samples other tokens."""
    k_greedy, greedy = first_rollout_tokens(["--temperature=0"], monkeypatch)
    k_one, top_one = first_rollout_tokens(["--temperature=1.0", "--top-k=1"], monkeypatch)
    k_default, sampled = first_rollout_tokens(["--temperature=1.0"], monkeypatch)
    assert (k_one, k_default) == (1, 50)
    assert top_one == greedy
    assert sampled != greedy
    assert len({tuple(map(tuple, q)) for q in top_one}) > 1  # not a degenerate model that always says the same


# ----------------------------------------------------------------------------- --memory-budget-gb

# one cached position (keys and values of every layer) of helpers.SFT_CONFIG in fp32:
# 2 (k, v) x 2 layers x 1 kv head x 32 dims (64 / 2 heads) x 4 bytes
KV_BYTES_PER_TOKEN = 2 * 2 * 1 * 32 * 4
MAX_NEW_TOKENS = 12  # TINY_RL_FLAGS


def test_memory_budget_bounds_the_rollout_rows(sft, base_dir, tiny_tokenizer, monkeypatch):
    """A budget of 4 completions' worth of KV cache cannot hold 4 rows (each also needs its prompt, stored once
    per question); a budget of 4 whole rows (prompt + completion each) holds at least 4; the default 4 GiB holds
    all 16 rows of the step (4 questions x 4 samples) at once."""
    from rl_toy_task import ParityTask
    longest_prompt = max(len(tiny_tokenizer.render_for_completion(q)) for q in ParityTask("train"))
    gib = lambda tokens: tokens * KV_BYTES_PER_TOKEN / 2 ** 30

    def rows(flags):
        calls = record_rollouts(monkeypatch)
        chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--overwrite"] + flags)
        return calls[0][2]
    assert 1 <= rows([f"--memory-budget-gb={gib(4 * MAX_NEW_TOKENS)}"]) < 4
    assert 4 <= rows([f"--memory-budget-gb={gib(4 * (longest_prompt + MAX_NEW_TOKENS))}"]) < 16
    assert rows([]) == 16


# ----------------------------------------------------------------------------- lr and weight decay flags

LR_FLAGS = ["--embedding-lr=0.3", "--unembedding-lr=0.006", "--matrix-lr=0.03", "--weight-decay=0.1", "--init-lr-frac=0.5"]
WIDTH_SCALE = math.sqrt(768 / 64)  # nanochat's AdamW lrs were tuned at width 768: x (width / 768) ** -0.5


def expected_group(name, recipe):
    """(lr, weight decay) of a parameter's group for LR_FLAGS: the flag's lr (AdamW ones x WIDTH_SCALE) x 0.5."""
    late = recipe == "2026-07"
    if name == "lm_head.weight":
        return 0.006 * WIDTH_SCALE * 0.5, 0.01 if late else 0.0
    if name == "transformer.wte.weight":
        return 0.3 * WIDTH_SCALE * 0.5, 0.001 if late else 0.0
    if name == "resid_lambdas":  # the scalars are not flags: 0.5 x 0.01 and 0.5, times init_lr_frac all the same
        return 0.005 * 0.5, 0.05 if late else 0.0
    if name == "x0_lambdas":
        return 0.5 * 0.5, 0.0
    assert name.startswith("transformer.h."), name
    return 0.03 * 0.5, 0.1


@pytest.mark.parametrize("recipe, optimizer_types", [("2026-01", ["AdamW", "Muon"]), ("2026-07", ["MuonAdamW"])])
def test_lr_and_weight_decay_flags_reach_the_param_groups(recipe, optimizer_types, sft, base_dir, monkeypatch):
    runs = capture_runs(monkeypatch)
    chat_rl.main(TINY_RL_FLAGS + LR_FLAGS + [f"--recipe={recipe}"])
    run = runs[0]
    assert [type(opt).__name__ for opt in run.optimizers] == optimizer_types
    names = {id(p): n for n, p in run.model.named_parameters()}
    seen = []
    for opt in run.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                lr, weight_decay = expected_group(names[id(p)], recipe)
                assert group["lr"] == pytest.approx(lr, rel=1e-12), names[id(p)]
                assert group["initial_lr"] == pytest.approx(lr, rel=1e-12), names[id(p)]  # what the schedule decays
                assert group["weight_decay"] == pytest.approx(weight_decay), names[id(p)]
                seen.append(names[id(p)])
    assert sorted(seen) == sorted(names.values())


# ----------------------------------------------------------------------------- --train-rows

def test_train_rows_changes_the_forwards_not_the_weights(sft, base_dir, monkeypatch):
    """auto (16 rows: here every trained row of the step's 4 questions) trains them in one forward of several
    questions instead of forwards of --train-rows=2 (as --device-batch-size=2, nanochat's passes), and the weights
    after 2 steps are the 2-row run's within fp32 rounding (each row keeps its 2-row pass's denominator)."""
    real, rows_seen = rl_run.accumulate_policy_gradient, []

    def accumulate(model, batches, *args, micro_batch_rows=None, **kwargs):
        rows_seen.append(micro_batch_rows)
        return real(model, batches, *args, micro_batch_rows=micro_batch_rows, **kwargs)
    monkeypatch.setattr(rl_run, "accumulate_policy_gradient", accumulate)
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--train-rows=2"])
    default = weights(rl_dir(base_dir) / "model_000001.pt")
    assert rows_seen == [2, 2]
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1", "--overwrite"])
    assert rows_seen[2:] == [16, 16]
    wide = weights(rl_dir(base_dir) / "model_000001.pt")
    assert default.keys() == wide.keys()
    assert any(not torch.equal(default[k], v) for k, v in sft.state_dict().items())  # the runs did train
    for k in default:
        torch.testing.assert_close(wide[k], default[k], rtol=1e-5, atol=1e-6, msg=k)
    # more rows than a question has are taken as given (a forward spans questions); a negative value is refused
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--save-every=-1", "--overwrite", "--train-rows=64"])
    assert rows_seen[4:] == [64]
    with pytest.raises(UserError, match="--train-rows must be >= 0"):
        chat_rl.main(TINY_RL_FLAGS + ["--num-steps=1", "--train-rows=-1"])


def test_train_rows_auto_is_the_devices_or_the_pass_if_larger():
    """--train-rows=0 (auto): AUTO_TRAIN_ROWS of the device type (64 on CUDA, measured on an H200; 16 on a CPU and
    elsewhere), or --device-batch-size if larger; a number as given, more than a question's rows too (a forward spans
    questions)."""
    def rows(device_type="cpu", **flags):
        args = argparse.Namespace(**{"train_rows": 0, "device_batch_size": 8, "num_samples": 16, **flags})
        return train_rows(args, device_type)
    assert AUTO_TRAIN_ROWS == {"cuda": 64, "cpu": 16}
    assert rows() == 16 and rows("cuda") == 64 and rows("mps") == 16
    assert rows(device_batch_size=32, num_samples=64) == 32  # never fewer than the pass
    assert rows("cuda", device_batch_size=128, num_samples=128) == 128
    assert rows(num_samples=8) == 16 and rows(device_batch_size=4, num_samples=12) == 16
    assert rows(train_rows=4) == 4 and rows("cuda", train_rows=4) == 4 and rows(train_rows=64) == 64


# ----------------------------------------------------------------------------- resume

def drop_step(directory, step):
    for f in directory.glob(f"*_{step:06d}*"):
        f.unlink()


def test_recipe_2026_07_runs_and_resumes_to_the_uninterrupted_weights(sft, base_dir, capsys):
    """--recipe is restored by --resume with the optimizer's state: the resumed run ends where the uninterrupted
    one did (resuming with the default 2026-01 recipe, or without the MuonAdamW state, would not)."""
    chat_rl.main(TINY_RL_FLAGS + ["--num-steps=3", "--save-every=1", "--recipe=2026-07"])
    uninterrupted = weights(rl_dir(base_dir) / "model_000002.pt")
    drop_step(rl_dir(base_dir), 2)
    capsys.readouterr()
    chat_rl.main(["--resume=d2:1", "--device-type=cpu"])
    assert "Resuming RL run d2 after step 1" in capsys.readouterr().out
    assert_same_weights(weights(rl_dir(base_dir) / "model_000002.pt"), uninterrupted)
    meta = json.loads((rl_dir(base_dir) / "meta_000002.json").read_text())
    assert meta["user_config"]["recipe"] == "2026-07" and [r["step"] for r in meta["history"]] == [0, 1, 2]
