"""SFT: the batch builder, the step's loss normalization, the example order, the non-finite guard, flag
validation, a tiny run from scratch whose checkpoint chat_rl's loader picks up, 2 gloo ranks vs 1 process, and
the stop on held-out pass@1 (--stop-at-pass1, nanochat/stop_rule.py): scripts/chat_sft.py and nanochat/sft/."""

import contextlib
import io
import json
import os
import re

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import PYTHONPATH, random_model, tiny_config
from rl_toy_task import ParityTask, ScriptedParity

from nanochat.checkpoints.loading import load_model
from nanochat.cli import run_main
from nanochat.engine.engine import Engine
from nanochat.engine.spec import rollout_spec
from nanochat.optim.optimizers import lr_multiplier
from nanochat.rl.evaluation import sample_outcomes
from nanochat.model.gpt import build_fresh_model
from nanochat.sft import stopping
from nanochat.sft.data import (collate_rows, count_targets, make_micro_batches, mixture_order, rank_positions,
                               render_rows)
from nanochat.sft.training import accumulate_gradient, loss_sums, train_step
from nanochat.stop_rule import BandNotReachedError, JumpedOverBandError, PassBand, held_out_indices, measure_pass1
from scripts import chat_sft
from scripts.chat_sft import main
from tasks.arithmetic import Arithmetic


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


@pytest.mark.slow
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
    (["--dtype=float16"], "--dtype must be auto, float32 or bfloat16"),
    (["--init-lr-frac=0"], "--init-lr-frac must be in (0, 1]"),
    (["--model-tag=d4"], "do not apply with --depth"),
    (["--stop-at-pass1=0.3"], "--stop-at-pass1 must be LO:HI (two numbers such as 0.25:0.5), got '0.3'"),
    (["--stop-at-pass1=0.5:0.3"], "--stop-at-pass1 must be LO:HI with 0 <= LO < HI <= 1, got '0.5:0.3'"),
    (["--stop-at-pass1=0.2:1.5"], "--stop-at-pass1 must be LO:HI with 0 <= LO < HI <= 1"),
    (["--stop-at-pass1=0.2:0.5", "--stop-check-every=0"], "--stop-check-every must be >= 1, got 0"),
    (["--stop-at-pass1=0.2:0.5", "--stop-check-questions=0"], "--stop-check-questions must be >= 1, got 0"),
    (["--stop-at-pass1=0.2:0.5", "--stop-check-samples=-1"], "--stop-check-samples must be >= 1, got -1"),
    (["--stop-check-every=5"], "--stop-check-every applies with --stop-at-pass1, which is not given"),
    (["--sequence-len=64", "--max-seq-len=65"], "--max-seq-len (65) exceeds the model's sequence_len (64), beyond which "
                                                "its attention windows slide; use at most 64"),
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
    import nanochat.runtime.dtypes
    monkeypatch.setattr(nanochat.runtime.dtypes, "cpu_has_native_bf16", lambda: False)
    run_main(main, ["--depth=1", "--sequence-len=64", "--tasks=arithmetic", "--arithmetic-difficulty=1", "--num-steps=1",
                    "--examples-per-step=2", "--device-batch-size=2", "--eval-every=-1", "--device-type=cpu",
                    "--dtype=bfloat16", "--output-tag=dtype"])
    assert "computing in float32 instead of bfloat16" in capsys.readouterr().out
    meta = json.loads((base_dir / "chatsft_checkpoints" / "dtype" / "meta_000001.json").read_text())
    assert meta["user_config"]["dtype"] == "float32"


# ----------------------------------------------------------------------------- stop on held-out pass@1

def test_pass_band_continues_below_stops_inside_and_fails_above_or_at_the_cap():
    band = PassBand(0.25, 0.5)
    assert band.observe(5, 0.0) is False and band.observe(10, 0.2499) is False
    assert band.observe(15, 0.25) is True  # both ends belong to the band
    assert band.summary() == {"band": [0.25, 0.5], "step": 15, "pass1": 0.25, "in_band": True,
                              "checks": [[5, 0.0], [10, 0.2499], [15, 0.25]]}
    assert PassBand(0.25, 0.5).observe(5, 0.5) is True
    assert PassBand(0.25, 0.5).observe(300, 0.4, final=True) is True  # in the band at the cap: a stop, not an error

    band = PassBand(0.25, 0.5)
    band.observe(5, 0.1)
    with pytest.raises(JumpedOverBandError) as exc:
        band.observe(10, 0.6)
    assert str(exc.value) == "held-out sampled pass@1 jumped over the band [0.25, 0.5]: 0.6000 at step 10, from 0.1000 at step 5"
    assert exc.value.band is band and band.summary()["in_band"] is False and band.last == (10, 0.6)
    with pytest.raises(JumpedOverBandError, match="0.9000 at step 5, at the first check"):
        PassBand(0.25, 0.5).observe(5, 0.9)

    band = PassBand(0.25, 0.5)
    assert band.observe(10, 0.1, final=False) is False
    with pytest.raises(BandNotReachedError) as exc:
        band.observe(12, 0.2, final=True)
    assert str(exc.value) == "held-out sampled pass@1 is 0.2000 at step 12, the step cap, still below the band [0.25, 0.5]"
    assert band.summary()["step"] == 12 and not band.in_band()


def test_held_out_questions_are_the_last_ones():
    assert list(held_out_indices(16, 4)) == [12, 13, 14, 15]
    for k in (0, 16):
        with pytest.raises(ValueError, match=f"cannot hold out {k} of 16"):
            held_out_indices(16, k)


class RecordingParity(ParityTask):
    """ParityTask that notes, at each grading, whether the model it watches was in train mode."""
    model = None
    modes = []

    def evaluate(self, conversation, response_text):
        self.modes.append(self.model.training)
        return super().evaluate(conversation, response_text)


def test_measure_pass1_is_the_mean_fraction_of_correct_samples_in_eval_mode(tiny_tokenizer):
    """A real measurement on a random tiny model (ParityTask: ~half the samples correct): the counts of
    sample_outcomes at T=1, top-k 50, sampled in eval mode under the given autocast; the model's mode comes back;
    a second check with the same engine reuses its static batch."""
    model = random_model(tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size()), noise=0.3)
    task = RecordingParity(split="train")
    RecordingParity.model, RecordingParity.modes = model, []
    indices = held_out_indices(len(task), 6)
    entered = []

    @contextlib.contextmanager
    def autocast():
        entered.append(True)
        yield

    model.train()
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
    pass1 = measure_pass1(engine, task, indices, 4, 12, autocast(), "cpu", seed=3)
    assert model.training and entered == [True]
    kept = engine.memory.kept_batch
    assert measure_pass1(engine, task, indices, 4, 12, contextlib.nullcontext(), "cpu", seed=3) == pass1
    # the next check reuses the batch (on CUDA: its graphs)
    assert kept is not None and engine.memory.kept_batch is kept
    assert RecordingParity.modes and not any(RecordingParity.modes)
    model.eval()
    outcomes = sample_outcomes(Engine(model, tiny_tokenizer), task, list(indices), 4, 12, temperature=1.0, top_k=50, seed=3)
    rewards = [r for o in outcomes for r in o.rewards]
    assert 0 < sum(rewards) < len(rewards)  # mixed, so the mean is a real check
    assert pass1 == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)


def test_measure_pass1_equals_hand_scripted_outcomes(tiny_tokenizer):
    """An independent reference: ScriptedParity grades each sample from a hand-written table, so the held-out
    pass@1 is known without sampling code: questions 10..15 have 1, 2, 0, 4, 1, 3 of 4 samples right, 11/24.
    A second check grades the same table again (its counters wrap at 4 samples): 11/24 again; 3 samples per
    question read the first 3 of each row: (1 + 2 + 0 + 3 + 1 + 3) / 18 = 10/18."""
    model = random_model(tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size()), noise=0.3)
    engine, task = Engine(model, tiny_tokenizer), ScriptedParity(split="train")
    indices = held_out_indices(len(task), 6)
    assert measure_pass1(engine, task, indices, 4, 8, contextlib.nullcontext(), "cpu") == pytest.approx(11 / 24, abs=1e-12)
    assert measure_pass1(engine, task, indices, 4, 8, contextlib.nullcontext(), "cpu", seed=5) == pytest.approx(11 / 24, abs=1e-12)
    assert sum(task.graded.values()) == 48
    task = ScriptedParity(split="train")
    assert measure_pass1(engine, task, indices, 3, 8, contextlib.nullcontext(), "cpu") == pytest.approx(10 / 18, abs=1e-12)


STOP_FLAGS = ["--depth=1", "--sequence-len=64", "--tasks=rl_toy_task:ParityTask", "--examples-per-step=4",
              "--device-batch-size=4", "--eval-every=-1", "--dtype=float32", "--device-type=cpu",
              "--stop-at-pass1=0.25:0.5", "--stop-check-questions=4"]


def scripted_sft(monkeypatch, values, flags):
    """chat_sft on ParityTask (16 train questions, the last 4 held out) with measure_pass1 answering `values` in
    turn. Returns (exit code, stdout, stderr lines, the held-out indices each check asked for, the questions trained on)."""
    checks, trained = [], []

    engines = []

    def measure(engine, task, indices, *args, **kwargs):
        engines.append(engine)
        assert engine is engines[0], "each check made its own engine"  # fails the run (non-zero exit)
        checks.append(list(indices))
        return values[len(checks) - 1]

    def micro_batches(tokenizer, conversations, *args):
        trained.extend(c["messages"][0]["content"] for c in conversations)
        return make_micro_batches(tokenizer, conversations, *args)

    monkeypatch.setattr(stopping, "measure_pass1", measure)
    monkeypatch.setattr(chat_sft, "make_micro_batches", micro_batches)
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_main(main, STOP_FLAGS + flags)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue().splitlines(), checks, trained


def _stop_meta(base_dir, step):
    checkpoint_dir = base_dir / "chatsft_checkpoints" / "stop"
    assert sorted(os.listdir(checkpoint_dir)) == [f"meta_{step:06d}.json", f"model_{step:06d}.pt"]
    return json.loads((checkpoint_dir / f"meta_{step:06d}.json").read_text())


def test_stops_at_the_first_check_in_the_band_and_records_it(base_dir, monkeypatch):
    code, out, err, checks, trained = scripted_sft(monkeypatch, [0.1, 0.3, 0.4],
                                                   ["--num-steps=6", "--stop-check-every=2", "--output-tag=stop"])
    assert code == 0 and err == []
    assert checks == [[12, 13, 14, 15]] * 2
    assert len(trained) == 4 * 4
    step_lines = [line for line in out.splitlines() if re.match(r"step \d+/\d+ \| loss ", line)]
    assert [line.split(" |")[0] for line in step_lines] == [f"step {s}/6" for s in range(1, 5)]
    assert f"| lrm {lr_multiplier(3, 6):.3f} |" in step_lines[-1]  # the schedule is the one over the cap
    assert re.search(r"^step 2/6 \| held-out pass@1 0\.1000 \(band \[0\.25, 0\.5\]\) \| check \d+\.\ds$", out, re.M)
    assert ("stop: step 4/6 | held-out pass@1 0.3000 in the band [0.25, 0.5] "
            "(4 train questions x 4 samples)\n") in out
    meta = _stop_meta(base_dir, 4)
    assert meta["step"] == 4
    assert meta["stop"] == {"band": [0.25, 0.5], "step": 4, "pass1": 0.3, "in_band": True, "checks": [[2, 0.1], [4, 0.3]],
                            "task": "rl_toy_task:ParityTask", "split": "train", "questions": 4, "first_question": 12,
                            "samples": 4}
    assert meta["user_config"]["stop_check_samples"] == 4 and meta["user_config"]["stop_check_max_tokens"] == 256


def test_the_held_out_questions_are_never_trained_on(base_dir, monkeypatch):
    """7 steps of 4 take 28 examples, more than two passes over the 12 questions left for training; the cap is
    checked too, though 7 is not a multiple of the check period. Below the band there, the run fails with one
    line and keeps its model, marked as outside the band."""
    code, out, err, checks, trained = scripted_sft(monkeypatch, [0.0, 0.1, 0.2],
                                                   ["--num-steps=7", "--stop-check-every=3", "--output-tag=stop"])
    assert sorted(set(trained)) == sorted(f"question {i}" for i in range(12))
    assert len(trained) == 28 and all(trained.count(f"question {i}") >= 2 for i in range(12))
    assert checks == [[12, 13, 14, 15]] * 3
    assert code == 2
    assert err == ["error: held-out sampled pass@1 is 0.2000 at step 7, the step cap, still below the band [0.25, 0.5]; "
                   "allow more steps (a larger --num-steps) or lower the band of --stop-at-pass1"]
    assert "(model_000007.pt, outside the band [0.25, 0.5])" in out and "stop: " not in out
    meta = _stop_meta(base_dir, 7)
    assert meta["stop"]["in_band"] is False and meta["stop"]["checks"] == [[3, 0.0], [6, 0.1], [7, 0.2]]


def test_a_jump_over_the_band_fails_with_one_line_and_keeps_the_model(base_dir, monkeypatch):
    code, out, err, checks, trained = scripted_sft(monkeypatch, [0.1, 0.7],
                                                   ["--num-steps=6", "--stop-check-every=2", "--output-tag=stop"])
    assert code == 2 and len(checks) == 2 and len(trained) == 4 * 4
    assert err == ["error: held-out sampled pass@1 jumped over the band [0.25, 0.5]: 0.7000 at step 4, from 0.1000 at "
                   "step 2; check more often (a smaller --stop-check-every) or widen the band of --stop-at-pass1"]
    meta = _stop_meta(base_dir, 4)
    assert meta["stop"]["in_band"] is False and meta["stop"]["pass1"] == 0.7


class CategoricalParity(ParityTask):
    eval_type = "categorical"


@pytest.mark.parametrize("flags,message", [
    ([f"--tasks={__name__}:CategoricalParity"], f"but '{__name__}:CategoricalParity' is categorical, not generative; "
                                                f"put a generative task (gsm8k, arithmetic) first in --tasks"),
    (["--stop-check-questions=16"], "--stop-check-questions (16) holds out every train question of "
                                    "'rl_toy_task:ParityTask' (16); hold out fewer"),
])
def test_stop_rule_needs_a_generative_first_task_with_questions_left(base_dir, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        run_main(main, STOP_FLAGS + ["--num-steps=2"] + flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_refuses_a_tag_holding_a_step_after_the_earliest_stop(base_dir, monkeypatch, capsys):
    """With a stop rule the run may save at its first check, so a checkpoint of the tag at a later step, even
    one before the cap, would be the one `--source=sft` loads."""
    code, *_ = scripted_sft(monkeypatch, [0.3], ["--num-steps=4", "--stop-check-every=3", "--output-tag=stop"])
    assert code == 0 and sorted(os.listdir(base_dir / "chatsft_checkpoints" / "stop"))[1] == "model_000003.pt"
    code, _, err, checks, _ = scripted_sft(monkeypatch, [0.3], ["--num-steps=8", "--stop-check-every=2", "--output-tag=stop"])
    assert code == 2 and checks == []
    assert "already holds model_000003.pt, a later step than step 2, where this run may stop" in err[0]


@pytest.mark.slow
def test_two_gloo_ranks_measure_and_stop_as_one_process(sft, base_dir, monkeypatch):
    """A held-out measurement on 2 gloo ranks, each sampling half of the 6 held-out questions: the counts are
    summed over ranks, so both ranks take the decision of one process and rank 0 records the pass@1 of all 6
    questions. The task grades from a hand-written table (rl_toy_task.ScriptedParity), so the value is known
    by hand: 11/24; rank 0's own half (questions 10, 12, 14) would give 1/6, so a missing sum shows."""
    common = ["--source=sft", "--model-tag=d2", "--tasks=rl_toy_task:ScriptedParity", "--num-steps=3", "--examples-per-step=4",
              "--device-batch-size=2", "--eval-every=-1", "--dtype=float32", "--device-type=cpu", "--seed=9",
              "--stop-at-pass1=0:1", "--stop-check-every=1", "--stop-check-questions=6", "--stop-check-max-tokens=12"]
    run_main(main, common + ["--output-tag=single"])
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)  # the ranks import rl_toy_task from tests/
    run_ranks(lambda rank: ["-m", "scripts.chat_sft", *common, "--output-tag=two"])
    checkpoints = base_dir / "chatsft_checkpoints"
    single = json.loads((checkpoints / "single" / "meta_000001.json").read_text())["stop"]
    two = json.loads((checkpoints / "two" / "meta_000001.json").read_text())["stop"]
    assert single["step"] == two["step"] == 1
    assert single["pass1"] == pytest.approx(11 / 24, abs=1e-12) and two["pass1"] == pytest.approx(11 / 24, abs=1e-12)
