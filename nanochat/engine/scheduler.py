"""
What a rollout's batch is made of and fed with, apart from running the model (the jobs of nano-vllm's Scheduler and
block manager): KeptBatches, the static batches kept between rollouts within the memory budget, so that a run makes
its batch and captures its CUDA graphs once; and Admission, a rollout's prompts on their way into the batch (waiting
for a prefill, then, prefilled, PrefilledPrompts, their samples waiting for free rows), their keys held in the prompt
slots a PromptPool gives out where the batch's cache holds prompts once for all their rows.
"""

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from nanochat.engine.kv_cache import KVCache

# Prompt positions one prefill forward takes at most, padding included: a step's 16 prompts, or 64 of an eval's, in one
# forward, while its transient KV cache and activations stay small beside the memory budget (d20 in bf16: 100 KB of
# keys and values a position, 0.8 GB at this limit)
PREFILL_TOKENS = 8192

# Static batches kept between rollouts at most, within the budget together: chat_rl's evals sample another shape
# than its steps, and with one batch kept each eval would replace the training batch and the next step make it
# again, its CUDA graphs captured anew each way, every eval.
KEEP_BATCHES = 2


class BatchShape(NamedTuple):
    """What a rollout's DecodeBatch is made for; a kept batch serves a rollout of the same shape."""
    rows: int
    prompt_slots: Optional[int]  # prompts held at once by a cache that stores them apart (None: rows copy them)
    prompt_cap: int              # the longest prompt it holds
    max_tokens: int
    num_samples: int
    dtype: torch.dtype           # of the KV cache
    temperature: float           # the sampler's settings (a captured step holds them as they were)
    top_k: Optional[int]


class KeptBatch(NamedTuple):
    """A static batch kept between rollouts, the shape it was made for, its cache's bytes, and whether its rows were
    what the memory budget left (fewer than the rollout's samples) rather than every sample (see Engine._new_batch)."""
    shape: BatchShape
    batch: object                # its DecodeBatch (decode_batch.py, which imports this module)
    nbytes: int
    budget_bound: bool


def cache_bytes(cache):
    """The bytes of a rollout cache's tensors (a static cache holds all it will ever use)."""
    return sum(value.nbytes for value in vars(cache).values() if isinstance(value, torch.Tensor))


def serves(kept, shape, limit, samples):
    """Whether the KeptBatch `kept` serves a rollout of `shape` (what the rollout's batch would be made for, given
    the kept batch's rows) with `samples` rows to sample and at most `limit` rows at once (None: no limit). Its rows
    must be those the rollout asks for: every sample (or `limit`, when given), or, for a batch made with what the
    budget left, still fewer than every sample."""
    rows = kept.shape.rows
    if kept.shape != shape:
        return False
    return rows == min(limit, samples) if limit else rows == samples or (kept.budget_bound and rows < samples)


class KeptBatches:
    """The static batches kept between rollouts (KeptBatch-es, the latest last): at most KEEP_BATCHES, their caches
    within the memory budget together. A batch in use by a rollout is out of the pool until the rollout ends."""

    def __init__(self):
        self.batches = []

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def __getitem__(self, index):
        return self.batches[index]

    @property
    def latest(self):
        """The batch kept last (by the last rollout that ran to its end), or None."""
        return self.batches[-1].batch if self.batches else None

    def keep(self, kept):
        self.batches.append(kept)

    def drop(self, keep_latest=False):
        """Drop every kept batch, or all but the latest. Returns how many it dropped."""
        keep = self.batches[-1:] if keep_latest else []
        dropped, self.batches = len(self.batches) - len(keep), keep
        return dropped

    def forget_shorter(self, prompt_cap):
        """Drop the batches made for prompts shorter than prompt_cap: no rollout can use them again (the engine's
        prompt capacity never shrinks)."""
        self.batches = [k for k in self.batches if k.shape.prompt_cap >= prompt_cap]

    def take(self, shape_of, limit, samples):
        """The first kept batch that serves the rollout (see serves; `shape_of(rows)` is the shape the rollout's batch
        would have with that many rows), taken out of the pool (in use until the rollout ends), or None."""
        for i, candidate in enumerate(self.batches):
            if serves(candidate, shape_of(candidate.shape.rows), limit, samples):
                return self.batches.pop(i)
        return None

    def rows_beside(self, budget_bytes, limit, samples, rows_for_budget):
        """The rows of a new batch beside the kept ones, dropping (oldest first) those whose room it needs: with at
        most KEEP_BATCHES kept at once, the rows the budget less the kept batches holds (`limit`, when given, if it
        fits there), once that is at least half of what the whole budget would hold. `rows_for_budget(bytes,
        at_least=1)` is how many rows that many bytes hold. In chat_rl the first eval, before any step, takes the
        whole budget; step 0's batch displaces it, and the next eval's batch, made beside the step's, serves every
        eval after: two eval batches and one step batch a run."""
        del self.batches[:max(0, len(self.batches) - (KEEP_BATCHES - 1))]  # room for this one among those kept
        whole = min(limit or rows_for_budget(budget_bytes), samples)
        while True:
            room = rows_for_budget(budget_bytes - sum(k.nbytes for k in self.batches), at_least=0)
            rows = max(1, min(limit or room, samples))
            if not self.batches or (rows <= room and 2 * rows >= whole):  # room 0: nothing fits beside them
                return rows
            del self.batches[0]  # the oldest; its memory is free before the new cache is allocated


class StoredPrompt(NamedTuple):
    """What the rows of a prompt held in a prompt slot take from its prefill (SharedPromptKVCache.admit_rows)."""
    prev_embedding: Optional[torch.Tensor]  # (1, 1, C) smear's state of its last token, or None


@dataclass
class PrefilledPrompt:
    """A prompt that went through the model once, while its samples wait for rows."""
    request: int               # index of the prompt
    seed: int                  # sample r draws from the stream row_seed(seed, r)
    num_samples: int
    cache: KVCache             # one row: the prompt's keys and values (a StoredPrompt once a prompt slot holds them)
    logits: torch.Tensor       # (1, V) after the prompt: every sample's first token is drawn from these
    length: int                # the prompt's tokens
    pool_slot: int = None      # the prompt slot holding its keys, when the batch's cache holds prompts
    admitted: int = 0          # samples 0..admitted-1 have had a row

    @property
    def fully_admitted(self):
        return self.admitted == self.num_samples

    def next_samples(self, free_rows):
        """The samples that take the next `free_rows` rows (fewer if fewer are left)."""
        return range(self.admitted, min(self.num_samples, self.admitted + free_rows))


class PromptPool:
    """Which prompt slot of a cache that holds prompts (SharedPromptKVCache) holds which prompt: a prompt takes
    a slot at its prefill and gives it back when the last of its rows finishes (nano-vllm's block manager, for
    whole prompts)."""

    def __init__(self, slots):
        self.free = deque(range(slots))
        self.slot_of, self.rows_left = {}, {}  # request -> its slot; -> its rows not finished, admitted or not

    def has_room(self):
        return len(self.free) > 0

    def free_slots(self):
        return len(self.free)

    def take(self, request, num_rows):
        self.slot_of[request], self.rows_left[request] = self.free.popleft(), num_rows
        return self.slot_of[request]

    def row_finished(self, request):
        self.rows_left[request] -= 1
        if self.rows_left[request] == 0:  # its prompt's keys are no longer read
            del self.rows_left[request]
            self.free.append(self.slot_of.pop(request))


def prefilled_prompts(prefill, requests, prompts, seeds, num_samples, pool, cache):
    """The PrefilledPrompts of `prompts` from their prefill (prefill_forward's KVCache and logits), in order. With a
    prompt pool each takes a prompt slot of `cache` and its keys are stored there; its rows then need only its smear
    state, and the prefill's (N, L) buffer is freed as soon as it is stored, not when the group's last prompt has all
    its rows (an eval's prompts wait for rows a long time)."""
    kv, logits = prefill
    out = []
    for i, (request, prompt, seed) in enumerate(zip(requests, prompts, seeds)):
        one = PrefilledPrompt(request, seed, num_samples, kv.row_prefix(i, len(prompt)), logits[i:i + 1],
                              length=len(prompt))
        if pool is not None:
            one.pool_slot = pool.take(request, num_samples)
            cache.store_prompt(one.pool_slot, one.cache)
            one.cache = StoredPrompt(None if kv.prev_embedding is None else kv.prev_embedding[i:i + 1].clone())
        out.append(one)
    return out


class Admission:
    """A rollout's prompts on their way into its batch: `waiting`, the indices (into prompts and seeds) of those not
    prefilled yet, and `pending`, the PrefilledPrompts whose samples are not all admitted yet. new_row(request,
    sample) makes a sample's Row; one prefill forward takes at most prefill_tokens positions."""

    def __init__(self, prompts, seeds, num_samples, new_row, prefill_tokens=PREFILL_TOKENS):
        self.prompts, self.seeds, self.num_samples = prompts, seeds, num_samples
        self.new_row, self.prefill_tokens = new_row, prefill_tokens
        self.waiting, self.pending = deque(range(len(prompts))), deque()

    @property
    def open(self):
        """Whether some prompt still has samples to admit."""
        return bool(self.waiting or self.pending)

    def next_prefill(self, room):
        """The requests of the next prefill, taken from the front of `waiting`: at most `room`, and (one at least) as
        many as fit prefill_tokens positions padded to the longest of them."""
        requests = [self.waiting.popleft()]
        longest = len(self.prompts[requests[0]])
        while self.waiting and len(requests) < room:
            longest = max(longest, len(self.prompts[self.waiting[0]]))
            if longest * (len(requests) + 1) > self.prefill_tokens:
                break
            requests.append(self.waiting.popleft())
        return requests

    def admit(self, batch):
        """Fill the batch's free rows: first with the samples of the pending prompts, then with those of the prompts
        it prefills from `waiting` (several in one forward, as many as prefill_room says), while its
        prompt pool has a free slot. Returns the events of the rows admitted."""
        events = []
        while batch.free_rows > 0 and self.open:
            if not self.pending:
                if batch.pool is not None and not batch.pool.has_room():
                    break  # every prompt slot holds a prompt whose rows still run: wait for one to finish
                requests = self.next_prefill(prefill_room(batch, self.num_samples))
                self.pending.extend(batch.prefill(requests, [self.prompts[r] for r in requests],
                                                  [self.seeds[r] for r in requests], self.num_samples))
            prompt = self.pending[0]
            events += batch.admit(prompt, [self.new_row(prompt.request, s) for s in prompt.next_samples(batch.free_rows)])
            if prompt.fully_admitted:
                self.pending.popleft()
        return events


def prefill_room(batch, num_samples):
    """How many prompts the batch's next prefill may take: its free prompt slots (a prompt holds one while its rows
    run), or without a pool, as many as fill its free rows (a prefilled prompt's own cache waits for its rows)."""
    return batch.pool.free_slots() if batch.pool is not None else -(-batch.free_rows // num_samples)
