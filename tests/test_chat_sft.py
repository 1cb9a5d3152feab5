"""SFT: the batch builder, the step's loss normalization, the example order, the non-finite guard, flag
validation, a tiny run from scratch whose checkpoint chat_rl's loader picks up, and 2 gloo ranks vs 1 process."""

import contextlib
import io
import json
import os
import re

import pytest
import torch

from nanochat.checkpoint_manager import load_model
from nanochat.cli import run_main
from nanochat.sft import (accumulate_gradient, collate_rows, count_targets, loss_sums, make_micro_batches,
                          mixture_order, rank_positions, render_rows)
from scripts.chat_sft import build_fresh_model, main, train_step
from tasks.arithmetic import Arithmetic
from gloo_ranks import run_ranks
from helpers import random_model, tiny_config


@pytest.fixture(autouse=True)
def one_thread():
    """These models are far too small to gain from intra-op threads, and on 2 cores shared with other test
    processes two spinning OpenMP threads made a 3 s test take up to 50 s."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------------- batch builder

def test_collate_rows_exact_values():
    rows = [([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),
            ([6, 7, 8], [0, 1, 0])]
    inputs, targets = collate_rows(rows, pad_token=99)
    assert inputs.tolist() == [[1, 2, 3, 4], [6, 7, 8, 99]]
    assert targets.tolist() == [[-1, 3, 4, 5], [7, -1, -1, -1]]
    assert inputs.dtype == targets.dtype == torch.long


def test_two_conversations_to_inputs_and_targets(tiny_tokenizer):
    tok = tiny_tokenizer
    sp = {s: tok.encode_special(s) for s in tok.get_special_tokens()}
    conv_a = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}
    conv_b = {"messages": [{"role": "user", "content": "2+3?"},
                           {"role": "assistant", "content": [{"type": "python", "text": "2+3"},
                                                             {"type": "python_output", "text": "5"},
                                                             {"type": "text", "text": "5"}]}]}
    hi, yes, q, expr, five = (tok.encode(t) for t in ("hi", "yes", "2+3?", "2+3", "5"))
    ids_a = [sp["<|bos|>"], sp["<|user_start|>"], *hi, sp["<|user_end|>"], sp["<|assistant_start|>"], *yes,
             sp["<|assistant_end|>"]]
    train_a = [0, 0, *[0] * len(hi), 0, 0, *[1] * len(yes), 1]
    ids_b = [sp["<|bos|>"], sp["<|user_start|>"], *q, sp["<|user_end|>"], sp["<|assistant_start|>"],
             sp["<|python_start|>"], *expr, sp["<|python_end|>"], sp["<|output_start|>"], *five, sp["<|output_end|>"],
             *five, sp["<|assistant_end|>"]]
    train_b = [0, 0, *[0] * len(q), 0, 0, 1, *[1] * len(expr), 1, 0, *[0] * len(five), 0, *[1] * len(five), 1]
    assert len(ids_b) > len(ids_a)

    pad = sp["<|assistant_end|>"]
    inputs, targets = make_micro_batches(tok, [conv_a, conv_b], max_seq_len=100, device_batch_size=2, pad_token=pad)[0]
    T = len(ids_b) - 1
    expected_inputs = [ids_a[:-1] + [pad] * (T - len(ids_a) + 1), ids_b[:-1]]
    expected_targets = [[t if m else -1 for t, m in zip(ids_a[1:], train_a[1:])] + [-1] * (T - len(ids_a) + 1),
                        [t if m else -1 for t, m in zip(ids_b[1:], train_b[1:])]]
    assert inputs.tolist() == expected_inputs
    assert targets.tolist() == expected_targets

    # truncation: at most max_seq_len (input, target) pairs per row
    (inputs, targets), = make_micro_batches(tok, [conv_b], max_seq_len=5, device_batch_size=1, pad_token=pad)
    assert inputs.tolist() == [ids_b[:5]]
    assert targets.tolist() == [[t if m else -1 for t, m in zip(ids_b[1:6], train_b[1:6])]]
    assert render_rows(tok, [conv_b], 5) == [(ids_b[:6], train_b[:6])]


# ----------------------------------------------------------------------------- example order

def test_mixture_order_is_a_seeded_permutation_and_ranks_partition_each_step():
    order = mixture_order([5, 3], seed=7)
    assert sorted(order) == [(0, i) for i in range(5)] + [(1, i) for i in range(3)]
    assert order == mixture_order([5, 3], seed=7)
    assert order != mixture_order([5, 3], seed=8)
    for step in range(3):
        single = rank_positions(step, 6, rank=0, world_size=1)
        assert single == list(range(6 * step, 6 * step + 6))
        per_rank = [rank_positions(step, 6, rank=r, world_size=3) for r in range(3)]
        assert all(len(p) == 2 for p in per_rank)
        assert sorted(sum(per_rank, [])) == single


# ----------------------------------------------------------------------------- loss normalization

def _random_model():
    # init_weights zeroes the output projections; random weights give every grad a value
    return random_model(tiny_config(sequence_len=32, vocab_size=50, n_head=2), noise=0.1, fresh=True)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_step_gradient_is_the_token_mean_over_all_ranks_and_micro_batches():
    """Rows with very different numbers of trained-on tokens, split over 2 simulated ranks and micro-batches
    of 2 rows: the rank-averaged gradient equals that of the plain token-mean loss over all rows. (A per
    micro-batch mean, as a naive accumulation would do, weights tokens unequally and does not match.)"""
    g = torch.Generator().manual_seed(3)
    rows = []
    for length, trained in [(12, 9), (5, 1), (20, 2), (8, 7), (15, 14), (6, 1), (9, 3), (4, 2)]:
        ids = torch.randint(0, 50, (length,), generator=g).tolist()
        rows.append((ids, [0] * (length - trained) + [1] * trained))
    model = _random_model()
    cpu, nothing = torch.device("cpu"), torch.autocast("cpu", enabled=False)

    # reference: one batch, mean over every target
    inputs, targets = collate_rows(rows, pad_token=0)
    model(inputs, targets).backward()
    reference = _grads(model)
    model.zero_grad()

    rank_rows = [rows[0::2], rows[1::2]]  # rank r takes every 2nd example
    rank_batches = [[collate_rows(rr[i:i + 2], 0) for i in range(0, len(rr), 2)] for rr in rank_rows]
    counts = [count_targets(b) for b in rank_batches]
    assert counts[0] != counts[1]
    denominator = sum(counts) / 2  # what all_reduce_mean of the counts gives
    rank_grads, rank_losses = [], []
    for batches in rank_batches:
        rank_losses.append(accumulate_gradient(model, batches, denominator, cpu, nothing))
        rank_grads.append(_grads(model))
        model.zero_grad()
    averaged = [(a + b) / 2 for a, b in zip(*rank_grads)]
    for got, want in zip(averaged, reference):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    with torch.no_grad():
        assert sum(rank_losses) / 2 == pytest.approx(model(inputs, targets).item(), rel=1e-5)

    # the naive normalization differs measurably, so the comparison above can fail
    for batches in rank_batches:
        for x, y in batches:
            (model(x, y) / (2 * len(batches))).backward()
    naive = _grads(model)
    assert max((a - b).abs().max().item() for a, b in zip(naive, reference)) > 1e-3


def test_train_step_refuses_a_non_finite_loss_and_steps_on_a_finite_one():
    model = _random_model()
    optimizers = model.setup_optimizers()
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    cpu, nothing = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    batch = [collate_rows([([1, 2, 3, 4], [0, 1, 1, 1])], pad_token=0)]
    with torch.no_grad():
        model.lm_head.weight[2, 0] = float("nan")  # the logits of every position turn nan
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss, _, updated = train_step(model, optimizers, batch, 1.0, cpu, "cpu", nothing)
    assert not updated and loss != loss  # nan
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) or k == "lm_head.weight" for k in before)
    assert torch.equal(before["lm_head.weight"].nan_to_num(), after["lm_head.weight"].nan_to_num())
    assert all(p.grad is None for p in model.parameters())

    with torch.no_grad():
        model.lm_head.weight[2, 0] = 0.0
        expected = model(*batch[0]).item()  # the token-mean loss before the update
    loss, gnorm, updated = train_step(model, optimizers, batch, 0.5, cpu, "cpu", nothing)
    assert updated and loss == pytest.approx(expected, rel=1e-5) and gnorm > 0
    assert not torch.equal(before["transformer.wte.weight"], model.transformer.wte.weight)
    assert all(g["lr"] == g["initial_lr"] * 0.5 for opt in optimizers for g in opt.param_groups)


# ----------------------------------------------------------------------------- end to end

SCRATCH_STEPS = 24


@pytest.fixture(scope="module")
def scratch_run(tmp_path_factory, tiny_tokenizer, gsm8k_dir):
    """One from-scratch SFT run on arithmetic, shared by the tests below: (base dir, console output)."""
    base = tmp_path_factory.mktemp("sft") / "nanochat"
    tiny_tokenizer.save(base / "tokenizer")
    argv = ["--depth=2", "--sequence-len=128", "--tasks=arithmetic", "--arithmetic-difficulty=1",
            f"--num-steps={SCRATCH_STEPS}", "--examples-per-step=8", "--device-batch-size=4", "--eval-every=12",
            "--eval-examples=8", "--dtype=float32", "--device-type=cpu", "--seed=5"]
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        mp.setenv("NANOCHAT_GSM8K_DIR", str(gsm8k_dir))
        torch.set_num_threads(1)  # see one_thread
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run_main(main, argv)
        torch.set_num_threads(threads)
        yield base, out.getvalue()


def _fixed_batch(tokenizer):
    convs = [Arithmetic(split="test", difficulty=1)[i] for i in range(8)]
    return make_micro_batches(tokenizer, convs, max_seq_len=128, device_batch_size=8,
                              pad_token=tokenizer.encode_special("<|assistant_end|>"))


def test_from_scratch_run_writes_a_checkpoint_that_sft_loading_finds_and_learns(scratch_run, tiny_tokenizer):
    base, out = scratch_run
    n = SCRATCH_STEPS
    step_lines = [line for line in out.splitlines() if re.match(r"step \d+/\d+ \| loss ", line)]
    assert [line.split(" |")[0] for line in step_lines] == [f"step {s}/{n}" for s in range(1, n + 1)]
    assert re.fullmatch(rf"step {n}/{n} \| loss \d+\.\d{{4}} \| lrm 0\.042 \| dt \d+ms \| grad norm \S+", step_lines[-1])
    val_lines = [line for line in out.splitlines() if " | val loss " in line]
    assert [line.split(" |")[0] for line in val_lines] == [f"step 0/{n}", f"step 12/{n}", f"step {n}/{n}"]
    val_losses = [float(line.split()[-1]) for line in val_lines]
    assert val_losses[-1] < val_losses[0]

    checkpoint_dir = base / "chatsft_checkpoints" / "d2"
    assert f"Saved checkpoint to {checkpoint_dir}" in out
    assert sorted(os.listdir(checkpoint_dir)) == [f"meta_{n:06d}.json", f"model_{n:06d}.pt"]
    meta = json.loads((checkpoint_dir / f"meta_{n:06d}.json").read_text())
    assert meta["step"] == n and meta["val_loss"] == pytest.approx(val_losses[-1], abs=1e-4)
    assert meta["model_config"] == dict(sequence_len=128, vocab_size=tiny_tokenizer.get_vocab_size(), n_layer=2,
                                        n_head=2, n_kv_head=2, n_embd=128, window_pattern="L")
    assert meta["user_config"]["init_lr_frac"] == 1.0 and meta["user_config"]["max_seq_len"] == 128

    model, tokenizer, loaded_meta = load_model("sft", "cpu", "eval")  # what chat_rl --source=sft does
    assert loaded_meta["step"] == n
    batch = _fixed_batch(tokenizer)
    cpu, nothing = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    final_sum, count = loss_sums(model, batch, cpu, nothing)
    torch.manual_seed(5)  # the run's seed: the same initial weights
    initial_sum, _ = loss_sums(build_fresh_model(2, 128, tokenizer.get_vocab_size(), cpu), batch, cpu, nothing)
    initial_loss, final_loss = initial_sum / count, final_sum / count
    assert final_loss < 0.6 * initial_loss, (initial_loss, final_loss)


def test_two_gloo_ranks_finetune_to_the_same_weights_as_one_process(scratch_run):
    """Finetuning the scratch run's checkpoint (--source=sft, default --init-lr-frac): each of 2 ranks takes
    half of every step's examples and the distributed optimizers average the gradients; with the token-mean
    denominator shared over ranks, the weights match a single-process run of the same steps.
    (From a fresh init the comparison is ill-posed: the residual scalars' first gradients are ~1e-10, at
    Adam's eps, so their update direction is decided by summation-order rounding.)"""
    base, _ = scratch_run
    common = ["--source=sft", "--model-tag=d2", "--tasks=arithmetic", "--num-steps=2", "--examples-per-step=4",
              "--device-batch-size=2", "--eval-every=-1", "--dtype=float32", "--device-type=cpu", "--seed=9"]
    run_main(main, common + ["--output-tag=single"])

    run_ranks(lambda rank: ["-m", "scripts.chat_sft", *common, "--output-tag=two"])

    checkpoints = base / "chatsft_checkpoints"
    start = torch.load(checkpoints / "d2" / f"model_{SCRATCH_STEPS:06d}.pt")
    single = torch.load(checkpoints / "single" / "model_000002.pt")
    two = torch.load(checkpoints / "two" / "model_000002.pt")
    assert single.keys() == two.keys() == start.keys()
    for key in single:
        moved = (single[key] - start[key]).abs().max().item()
        assert moved > 2e-5, key  # every tensor trained, by far more than the tolerance below
        torch.testing.assert_close(two[key], single[key], atol=1e-6, rtol=1e-5, msg=key)


# ----------------------------------------------------------------------------- flag validation

@pytest.mark.parametrize("flags,message", [
    (["--examples-per-step=6", "--device-batch-size=4"], "must be a multiple of --device-batch-size"),
    (["--matrix-lr=-0.1"], "--matrix-lr must be >= 0"),
    (["--tasks=nosuchtask"], "unknown task 'nosuchtask'"),
    (["--tasks=gsm8k,"], "empty entry"),
    (["--tasks=gsm8k", "--arithmetic-difficulty=2"], "not in --tasks"),
    (["--dtype=float16"], "--dtype must be float32 or bfloat16"),
    (["--init-lr-frac=0"], "--init-lr-frac must be in (0, 1]"),
    (["--model-tag=d4"], "do not apply with --depth"),
])
def test_invalid_flags_exit_2_with_one_line(base_dir, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        run_main(main, ["--depth=2", "--device-type=cpu", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_too_few_examples_for_one_step_is_a_user_error(base_dir, capsys):
    with pytest.raises(SystemExit) as exc:  # the GSM8K fixture has 12 train rows
        run_main(main, ["--depth=1", "--device-type=cpu", "--dtype=float32", "--examples-per-step=16",
                        "--device-batch-size=16", "--eval-every=-1"])
    assert exc.value.code == 2
    assert "12 train conversations, fewer than --examples-per-step (16)" in capsys.readouterr().err


def test_refuses_to_hide_its_checkpoint_behind_a_later_step(scratch_run, capsys):
    """Finetuning d2 for fewer steps than the d2 checkpoint it starts from, into the same tag, would save a
    model_N.pt that `load_model('sft')` never picks (it takes the largest N)."""
    with pytest.raises(SystemExit) as exc:
        run_main(main, ["--source=sft", "--model-tag=d2", "--tasks=arithmetic", "--num-steps=2", "--examples-per-step=4",
                        "--dtype=float32", "--device-type=cpu", "--eval-every=-1"])
    assert exc.value.code == 2
    assert f"already holds model_{SCRATCH_STEPS:06d}.pt" in capsys.readouterr().err
    assert sorted(os.listdir(scratch_run[0] / "chatsft_checkpoints" / "d2")) == [f"meta_{SCRATCH_STEPS:06d}.json",
                                                                                f"model_{SCRATCH_STEPS:06d}.pt"]


def test_checkpoint_records_the_dtype_the_run_computed_in(base_dir, monkeypatch, capsys):
    """Asked for bf16 on a CPU without native bf16, the run computes in fp32 and its saved config says so."""
    import nanochat.common
    monkeypatch.setattr(nanochat.common, "cpu_has_native_bf16", lambda: False)
    run_main(main, ["--depth=1", "--sequence-len=64", "--tasks=arithmetic", "--arithmetic-difficulty=1", "--num-steps=1",
                    "--examples-per-step=2", "--device-batch-size=2", "--eval-every=-1", "--device-type=cpu",
                    "--dtype=bfloat16", "--output-tag=dtype"])
    assert "computing in float32 instead of bfloat16" in capsys.readouterr().out
    meta = json.loads((base_dir / "chatsft_checkpoints" / "dtype" / "meta_000001.json").read_text())
    assert meta["user_config"]["dtype"] == "float32"
