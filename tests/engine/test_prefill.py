"""Prompts prefilled several at a time (DecodeBatch.prefill): right-padded to the longest in one forward, each
prompt's keys, values, smear state and first-token logits are those of a forward of it alone."""


import pytest
import torch
from helpers import prompt_of, random_model, tiny_config

from nanochat.engine.decode_batch import PREFILL_TOKENS, DecodeBatch, RolloutStats
from nanochat.engine.engine import Engine
from nanochat.engine.scheduler import Admission
from nanochat.engine.kv_cache import KVCache, forward_cached
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache

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
                engine = Engine(model, tiny_tokenizer, share_prompts=share, prefill_tokens=limit)
                out = engine.generate_many(prompts, num_samples=2, max_tokens=12, seeds=range(6), max_rows=12, **sampling)
                runs.append([[(c.tokens, c.masks) for c in per] for per in out])
                forwards.append(engine.last_stats.prefill_forwards)
            assert runs[0] == runs[1]
            assert forwards == [1, 6]  # 12 rows: every prompt's samples at once
