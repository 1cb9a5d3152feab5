"""The memory an engine holds (engine.memory, RolloutMemory) and how a rollout of its backs off when it runs out of
memory inside the engine's own call (generate_many(within_memory=True)): the batches kept from other rollouts given
back, then the rows halved, the same completions sampled and the same lines printed as chat_rl's rollouts always
printed."""

import pytest
import torch
from helpers import prompt_of, random_model, tiny_config

from nanochat.engine.engine import Engine
from nanochat.engine.spec import rollout_spec

QUESTIONS = ("What is 12 times 7?", "Tom has 3 apples", "Hi")
SAMPLING = dict(num_samples=4, max_tokens=10, temperature=1.0, top_k=50, seeds=[4, 5, 6])  # 12 rows


@pytest.fixture
def model(tiny_tokenizer):
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    return random_model(config)


def prompts_of(tokenizer):
    return [prompt_of(tokenizer, q) for q in QUESTIONS]


def tokens(results):
    return [[(c.tokens, c.masks) for c in per_prompt] for per_prompt in results]


def out_of_memory_over(model, rows):
    """`model`'s decode forwards (model(idx, cache_step=...)) run out of memory for a batch of more than `rows` rows,
    as a device with room for `rows` rows would. Returns the batch sizes that ran out."""
    real, failed = model.forward, []

    def forward(idx, *args, **kwargs):
        if idx.size(0) > rows:
            failed.append(idx.size(0))
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real(idx, *args, **kwargs)
    model.forward = forward
    return failed


def test_a_rollout_within_memory_halves_its_rows_until_they_fit(model, tiny_tokenizer, capsys):
    """12 rows on a device that holds 4: the rollout runs with 6, then 3 rows, printing chat_rl's lines, and samples
    exactly what an unconstrained engine samples (each row its own stream). The rows stay halved for later
    rollouts, which then run at once."""
    prompts = prompts_of(tiny_tokenizer)
    expected = tokens(Engine(model, tiny_tokenizer).generate_many(prompts, **SAMPLING))
    engine = Engine(model, tiny_tokenizer)
    failed = out_of_memory_over(model, 4)
    assert tokens(engine.generate_many(prompts, within_memory=True, **SAMPLING)) == expected
    assert capsys.readouterr().out.splitlines() == ["out of memory during rollouts: retrying with --max-rows=6",
                                                    "out of memory during rollouts: retrying with --max-rows=3"]
    assert failed == [12, 6] and engine.memory.max_rows == 3
    assert tokens(engine.generate_many(prompts, within_memory=True, **SAMPLING)) == expected
    assert capsys.readouterr().out == "" and failed == [12, 6]


def test_a_rollout_without_the_back_off_raises_and_changes_nothing(model, tiny_tokenizer, capsys):
    """chat_eval's and the evals' rollouts do not back off: the out-of-memory is the caller's, the rows untouched."""
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, max_rows=8))
    out_of_memory_over(model, 4)
    with pytest.raises(torch.OutOfMemoryError):
        engine.generate_many(prompts_of(tiny_tokenizer), **SAMPLING)
    assert engine.memory.max_rows == 8 and capsys.readouterr().out == ""


def test_the_back_off_runs_with_the_engines_rows_not_a_callers(model, tiny_tokenizer):
    """Its halved rows are the engine's for later rollouts: a call's own cap would leave them to the next call."""
    engine = Engine(model, tiny_tokenizer)
    with pytest.raises(ValueError, match=r"^generate_many\(within_memory=True\) runs with the engine's rows; pass no "
                                         "max_rows$"):
        engine.generate_many(prompts_of(tiny_tokenizer), max_rows=4, within_memory=True, **SAMPLING)


def test_one_row_out_of_memory_is_the_callers(model, tiny_tokenizer, capsys):
    engine = Engine(model, tiny_tokenizer)
    out_of_memory_over(model, 0)
    with pytest.raises(torch.OutOfMemoryError):
        engine.generate_many(prompts_of(tiny_tokenizer), within_memory=True, **SAMPLING)
    assert capsys.readouterr().out.splitlines()[-1] == "out of memory during rollouts: retrying with --max-rows=1"


def test_a_rollout_first_gives_back_the_batches_kept_from_other_rollouts(model, tiny_tokenizer, capsys):
    """A static engine keeps an eval's batch (2 samples a prompt) beside a step's; out of memory once in the step's
    rollout, it gives the kept batches back and retries with the same rows: nothing halved, the same samples."""
    prompts = prompts_of(tiny_tokenizer)
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
    expected = tokens(engine.generate_many(prompts, **SAMPLING))
    engine.generate_many(prompts, **{**SAMPLING, "num_samples": 2})  # an eval's, kept beside the step's
    assert [k.shape.num_samples for k in engine.memory.kept] == [4, 2]
    real, raised = model.forward, []

    def forward(*args, **kwargs):
        if not raised:
            raised.append(True)
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real(*args, **kwargs)
    model.forward = forward
    assert tokens(engine.generate_many(prompts, within_memory=True, **SAMPLING)) == expected
    assert capsys.readouterr().out.splitlines() == [
        "out of memory during rollouts: gave back the 1 decode batch(es) kept from other rollouts; retrying"]
    assert engine.memory.max_rows is None and [k.shape.num_samples for k in engine.memory.kept] == [4]


def test_a_retry_takes_back_what_the_progress_counted(model, tiny_tokenizer, capsys):
    """Out of memory once rows have finished: the retry samples every row anew, so it first takes back what the
    failed attempt counted (a bar then counts the rows of the attempt that runs) and the count ends at every row."""
    prompts = prompts_of(tiny_tokenizer)
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, max_rows=4))  # 12 rows, 4 at a time
    counts, real = [], model.forward

    def forward(*args, **kwargs):
        if len(counts) == 1:  # rows have finished (one report so far), none taken back yet
            counts.append("raised")
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real(*args, **kwargs)
    model.forward = forward
    engine.generate_many(prompts, within_memory=True, progress=counts.append, **SAMPLING)
    assert counts[:3] == [4, "raised", -4] and sum(counts[3:]) == 12 and all(n > 0 for n in counts[3:])
    assert capsys.readouterr().out.splitlines() == ["out of memory during rollouts: retrying with --max-rows=2"]


def test_yield_memory_gives_back_the_evals_batch_then_all_it_keeps(model, tiny_tokenizer):
    """What chat_rl's training asks for when it runs out of memory: first the batches kept from other rollouts (the
    latest stays), then that one and the decode weights, after which later rollouts keep nothing; then nothing."""
    prompts = prompts_of(tiny_tokenizer)
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static"))
    engine.generate_many(prompts, **{**SAMPLING, "num_samples": 2})  # an eval's
    engine.generate_many(prompts, **SAMPLING)  # the step's, kept last
    step_batch = engine.memory.kept_batch
    assert engine.memory.yield_memory() == ("the 1 decode batch(es) the rollout engine keeps from other rollouts "
                                            "(an eval's)")
    assert [k.batch for k in engine.memory.kept] == [step_batch] and engine.memory.keeps_between_rollouts
    assert engine.memory.yield_memory() == ("the KV cache, decode graphs and weights the rollout engine keeps between "
                                            "rollouts (it keeps none from now on)")
    assert engine.memory.kept_batch is None and not engine.memory.keeps_between_rollouts
    engine.generate_many(prompts, **SAMPLING)
    assert engine.memory.kept_batch is None and engine.memory.yield_memory() is None


def test_a_new_spec_starts_the_memory_afresh_and_brings_its_rows(model, tiny_tokenizer):
    """Engine.reconfigure: a spec that changes how batches are made drops what the memory keeps; any new spec's
    rows replace the rows an out-of-memory halved."""
    prompts = prompts_of(tiny_tokenizer)
    engine = Engine(model, tiny_tokenizer, rollout_spec(model, decode="static", max_rows=8))
    out_of_memory_over(model, 4)
    engine.generate_many(prompts, within_memory=True, **SAMPLING)
    assert engine.memory.max_rows == 4 and engine.memory.kept_batch is not None
    engine.reconfigure(rollout_spec(model, decode="static", max_rows=8, prefill_tokens=1))  # batches serve on
    assert engine.memory.max_rows == 8 and engine.memory.kept_batch is not None
    engine.reconfigure(rollout_spec(model, decode="eager", max_rows=6))
    assert engine.memory.max_rows == 6 and engine.memory.kept_batch is None and engine.memory.spec is engine.spec
