"""Prompts prefilled several at a time (DecodeBatch.prefill): right-padded to the longest in one forward, each
prompt's keys, values, smear state and first-token logits are those of a forward of it alone."""


import pytest
import torch
from helpers import prompt_of, random_model, tiny_config

from nanochat.engine.decode_batch import DecodeBatch, RolloutStats
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import KVCache, forward_cached
from nanochat.engine.scheduler import PREFILL_TOKENS, Admission
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.engine.spec import rollout_spec

TOL = dict(rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("generation", ["jan2026", "smear"])  # windows; windows + smear state + value embeddings
@pytest.mark.parametrize("share", [True, False])
def test_each_prompt_of_a_batched_prefill_is_as_if_prefilled_alone(generation, share):
    config = tiny_config(sequence_len=16, window_pattern="SL")  # short window 8: the longest prompt passes it
    model = random_model(config, generation=generation).double()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 13, 1, 9)]
    if share:
        cache = SharedPromptKVCache.for_model(model, 8, 4, 16, 8, 2, torch.float64)
    else:
        cache = KVCache.for_model(model, 8, 32, torch.float64)
    batch = DecodeBatch(model, cache, 1.0, None, RolloutStats())
    with torch.no_grad():
        prefilled = batch.prefill([10, 11, 12, 13], prompts, [1, 2, 3, 4], num_samples=2)
        assert batch.stats.prefill_forwards == 1 and batch.stats.prefill_tokens == 5 + 13 + 1 + 9
        for one, prompt, request in zip(prefilled, prompts, [10, 11, 12, 13]):
            alone = KVCache.for_model(model, 1, len(prompt), torch.float64)
            logits = forward_cached(model, torch.tensor([prompt]), alone)[:, -1]  # (1, V)
            assert (one.request, one.length) == (request, len(prompt))
            torch.testing.assert_close(one.logits, logits, **TOL)
            if generation == "smear":
                torch.testing.assert_close(one.cache.prev_embedding, alone.prev_embedding, **TOL)
            else:
                assert one.cache.prev_embedding is None
            if share:  # stored in its own prompt slot, as long as the prompt; the prefill's buffer is not kept
                assert int(cache.pool_len[one.pool_slot]) == len(prompt) and not hasattr(one.cache, "k")
                for stored, own in ((cache.pool_k, alone.k), (cache.pool_v, alone.v)):
                    torch.testing.assert_close(stored[:, one.pool_slot, :, :len(prompt)].transpose(1, 2), own[:, 0], **TOL)
            else:  # its rows copy its keys and values from it
                assert one.cache.max_seq_len == len(prompt) and int(one.cache.pos[0]) == len(prompt)
                torch.testing.assert_close(one.cache.k, alone.k, **TOL)
                torch.testing.assert_close(one.cache.v, alone.v, **TOL)
        if share:
            assert sorted(p.pool_slot for p in prefilled) == [0, 1, 2, 3]


def test_next_prefill_takes_the_room_and_the_token_limit():
    prompts = [[0] * n for n in (4, 6, 5, 20, 3, 40)]
    admission = Admission(prompts, seeds=range(6), num_samples=1, new_row=None, prefill_tokens=30)
    assert admission.next_prefill(room=2) == [0, 1]             # the room
    assert admission.next_prefill(room=9) == [2]                # 2 prompts padded to 20 > 30 positions
    assert admission.next_prefill(room=9) == [3]
    assert admission.next_prefill(room=9) == [4]                # [3, 40] padded: 80 > 30
    assert admission.next_prefill(room=9) == [5]                # alone, even past the limit
    assert not admission.waiting and not admission.open


def test_rollouts_prefill_prompts_together_and_sample_as_one_by_one(tiny_tokenizer):
    """A rollout prefills its prompts in a few forwards (as many as the prompt slots, or PREFILL_TOKENS, take); its
    completions are those of prompts prefilled one at a time (PREFILL_TOKENS = 1), greedy and sampled."""
    config = tiny_config(sequence_len=64, vocab_size=tiny_tokenizer.get_vocab_size(), window_pattern="SL")
    model = random_model(config, generation="smear")
    questions = ["a b", "Natalia sold 48 clips to her friends in April", "c", "Weng earns 12 an hour", "x y z", "q"]
    prompts = [prompt_of(tiny_tokenizer, q) for q in questions]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, top_k=20)):
        for share in (True, False):
            runs, forwards = [], []
            for limit in (PREFILL_TOKENS, 1):
                engine = Engine(model, tiny_tokenizer, rollout_spec(model, share_prompts=share, prefill_tokens=limit))
                out = engine.generate_many(prompts, num_samples=2, max_tokens=12, seeds=range(6), max_rows=12, **sampling)
                runs.append([[(c.tokens, c.masks) for c in per] for per in out])
                forwards.append(engine.last_stats.prefill_forwards)
            assert runs[0] == runs[1]
            assert forwards == [1, 6]  # 12 rows: every prompt's samples at once


def test_a_prefill_takes_prompts_up_to_exactly_its_token_budget():
    """Both sides of the budget (issue 67: `>=` for `>` passed this file): prompts of 4 tokens and a budget of 8 go two
    to a prefill (exactly 8 positions; a third would make 12), with a budget of 7 one at a time, and at most `room`."""
    def prefills(budget, room):
        admission, out = Admission([[1] * 4] * 3, [0, 1, 2], 1, new_row=None, prefill_tokens=budget), []
        while admission.waiting:
            out.append(admission.next_prefill(room))
        return out
    assert prefills(8, 5) == [[0, 1], [2]]
    assert prefills(7, 5) == [[0], [1], [2]]
    assert prefills(100, 2) == [[0, 1], [2]]


def test_a_prefill_without_a_prompt_pool_takes_the_prompts_that_fill_the_free_rows():
    """Without a prompt pool, as many prompts as fill the free rows, rounded up (issue 67: rounded down passed this
    file): 4 samples a prompt, 8 free rows take 2, 9 take 3, 1 takes 1; with a pool, its free slots."""
    from types import SimpleNamespace

    from nanochat.engine.scheduler import prefill_room
    assert [prefill_room(SimpleNamespace(pool=None, free_rows=free), 4) for free in (8, 9, 1)] == [2, 3, 1]
    assert prefill_room(SimpleNamespace(pool=SimpleNamespace(free_slots=lambda: 3), free_rows=100), 4) == 3


def test_a_new_batch_that_exactly_fits_beside_the_kept_one_keeps_it():
    """KeptBatches.rows_beside on both sides of the room (issue 67: `<` for `<=` passed): a budget of 100 bytes, 10 a
    row, one kept batch of 50: a new batch of 5 rows fits beside it exactly and it stays; one of 6 does not, and the
    kept one goes first."""
    from types import SimpleNamespace

    from nanochat.engine.scheduler import KeptBatches

    def rows_for_budget(nbytes, at_least=1):
        return max(at_least, nbytes // 10)
    for limit, rows, kept_after in ((5, 5, 1), (6, 6, 0)):
        kept = KeptBatches()
        kept.keep(SimpleNamespace(nbytes=50))
        assert kept.rows_beside(100, limit, 8, rows_for_budget) == rows and len(kept) == kept_after
