"""The RolloutCache interface (nanochat/engine/kv_cache.py) as the decode batch uses it, held against a full forward: every
cache kind, at a prefill, at decode steps of rows at different positions, after a row retires (the last row moved
into its place, its own row freed) and with a free row inside a static step, gives each row in use the logits of
the model run on that row's whole sequence. Float64, so the comparison is exact up to summation order."""

import pytest
import torch
from helpers import random_model, tiny_config

from nanochat.engine.kv_cache import KVCache, forward_cached
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.model.attention import run_cached

TOL = dict(atol=1e-10, rtol=0)
KINDS = ["copy", "shared", "shared-static"]


def new_cache(kind, model, rows, prompt_cap, max_tokens, num_samples):
    if kind == "copy":
        return KVCache.for_model(model, rows, prompt_cap + max_tokens, torch.float64)
    return SharedPromptKVCache.for_model(model, rows, 2, prompt_cap, max_tokens, num_samples, torch.float64,
                                         static=kind == "shared-static")


def full_logits(model, sequence):
    """The last position's logits of `sequence` (a list of ids) run whole, without a cache."""
    return model(torch.tensor([sequence]))[0, -1]


@pytest.mark.parametrize("generation", ["jan2026", "smear"])  # windows; windows + smear state + value embeddings
@pytest.mark.parametrize("kind", KINDS)
def test_every_cache_gives_each_row_the_full_forward(kind, generation):
    config = tiny_config(sequence_len=16, window_pattern="SL")  # short window 8: the steps slide past it
    model = random_model(config, generation=generation).double()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 5)]
    rows_of = [0, 0, 1]  # rows 0 and 1 sample prompt 0, row 2 prompt 1
    cache = new_cache(kind, model, 3, 16, 12, num_samples=2)
    cache.active.zero_()
    with torch.no_grad():
        # prefill: each prompt once, into a one-row cache; the rollout cache stores it (shared) or copies it
        prompt_caches = []
        for slot, prompt in enumerate(prompts):
            one = KVCache.for_model(model, 1, len(prompt), torch.float64)
            torch.testing.assert_close(forward_cached(model, torch.tensor([prompt]), one)[0, -1], full_logits(model, prompt), **TOL)
            if cache.holds_prompts():
                cache.store_prompt(slot, one)
            prompt_caches.append(one)
        held = [cache.admit_rows(r, r + 1, prompt_caches[p], p, sample)
                for r, (p, sample) in enumerate(zip(rows_of, [0, 1, 0]))]
        assert held == ([9, 9, 5] if kind == "copy" else [0, 0, 0])
        sequences = [list(prompts[p]) for p in rows_of]
        own = list(held)  # keys each row holds in its own storage

        def step(rows, live):
            """One decode step over cache rows 0..rows-1, feeding each live row its next token; returns logits."""
            tokens = torch.randint(0, 300, (rows,), generator=gen)
            keys = max(own[r] for r in live) + 1
            logits = run_cached(model, tokens[:, None], cache.decode_step(rows, keys))[:, -1]
            for r in live:
                sequences[r].append(int(tokens[r]))
                own[r] += 1
                torch.testing.assert_close(logits[r], full_logits(model, sequences[r]), **TOL)
            return logits

        for _ in range(6):  # rows of lengths 10.., 10.. and 6..: past the short window
            step(3, [0, 1, 2])
        # row 0 retires: the last row moves into its place, its own row is freed
        cache.copy_rows(0, 2)
        cache.release_row(2)
        sequences[0], own[0] = sequences[2], own[2]
        positions = cache.pos.clone()
        if kind == "shared":  # a dynamic step runs only the rows in use
            step(2, [0, 1])
        else:  # a static step runs its whole bucket, the free row included: it stays where it is, at 0
            step(3, [0, 1])
            assert int(cache.pos[2]) == 0 and int(cache.active[2]) == 0
        assert cache.pos[:2].tolist() == (positions[:2] + 1).tolist()
        for _ in range(3):
            step(2, [0, 1])
    assert cache.keys_read(2, 5) == (2 * 5 if kind == "copy" else 2 * 16 + 2 * 5)


@pytest.mark.parametrize("generation", ["jan2026", "smear"])  # without and with smear's prev_embedding
def test_a_shared_prompt_prefix_view_has_every_field_of_its_cache(generation):
    """prefix(rows) builds its view field by field (Dynamo cannot trace copying __dict__): it has every field the
    cache has, per-row ones cut to the first rows and sharing storage, the rest the cache's own."""
    model = random_model(tiny_config(), generation=generation)
    cache = SharedPromptKVCache.for_model(model, 6, 2, 16, 40, rows_per_slot=3, static=True)
    view = cache.prefix(4)
    assert set(vars(view)) == set(vars(cache))
    for name, value in vars(cache).items():
        if isinstance(value, torch.Tensor) and value.size(0) == 6 and name not in ("k", "v"):
            assert view.__dict__[name].shape[0] == 4 and view.__dict__[name].data_ptr() == value.data_ptr(), name
        elif name in ("k", "v"):
            assert view.__dict__[name].shape[1] == 4 and view.__dict__[name].data_ptr() == value.data_ptr(), name
        elif name != "suffix_cap":
            assert view.__dict__[name] is value, name
    assert (view.prev_embedding is None) == (generation != "smear")
