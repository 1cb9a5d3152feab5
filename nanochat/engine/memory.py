"""
The memory an Engine holds (RolloutMemory, one per engine, engine.memory): the static batches it keeps between
rollouts, its decode weights, whether it keeps them at all, and the rows a rollout decodes at once at most; how many
rows the memory budget holds (rows_for_budget); what it gives back to other work that ran out of memory
(yield_memory: chat_rl's training), and how one of its own rollouts backs off when it runs out (within_memory: the
kept batches given back, then the rows halved). Nothing outside the engine writes its fields: a run asks through its
methods.
"""

from functools import partial

from nanochat.engine.decode_weights import DecodeWeights
from nanochat.engine.kv_cache import cache_geometry
from nanochat.engine.scheduler import KeptBatches
from nanochat.runtime.device import with_fewer_rows_on_oom

# the lines a rollout that runs out of memory prints before it retries (chat_rl's --max-rows caps the rows)
GAVE_BACK_LINE = ("out of memory during rollouts: gave back the {dropped} decode batch(es) kept from other rollouts; "
                  "retrying")
FEWER_ROWS_LINE = "out of memory during rollouts: retrying with --max-rows={rows}"


def rows_in_budget(bytes_per_token, budget_bytes, prompt_len, max_tokens, num_samples, share_prompts, at_least):
    """How many rows' KV cache fit in `budget_bytes` (and at least `at_least`): prompt + completion per row, or with
    shared prompts a completion per row plus the prompt pool (about 2 prompts per num_samples rows, see
    engine.prompt_slots)."""
    budget_tokens = max(0.0, budget_bytes / bytes_per_token)
    if not share_prompts:
        return max(at_least, int(budget_tokens // (prompt_len + max_tokens)))
    return max(at_least, int((budget_tokens - prompt_len) // (max_tokens + 2 * prompt_len / num_samples)))


class CountedProgress:
    """A rollout's progress(n) (n rows just finished), counted, so that a retry after an out-of-memory takes back
    what the failed attempt counted (progress(-n)): a progress bar counts the rows of the attempt that runs."""

    def __init__(self, progress):
        self.progress, self.counted = progress, 0

    def __call__(self, finished):
        self.counted += finished
        self.progress(finished)

    def restart(self):
        if self.counted:
            self.progress(-self.counted)
            self.counted = 0


class RolloutMemory:
    """The memory of an engine of `model` run as RolloutSpec `spec`: the static batches it keeps between rollouts
    (kept), its decode weights (weights), whether it keeps them at all (keeps_between_rollouts), and the rows a
    rollout decodes at once at most (max_rows: the spec's, halved where a rollout runs out of memory)."""

    def __init__(self, model, spec):
        self.model, self.spec = model, spec
        self.kept = KeptBatches()  # between rollouts (see Engine._new_batch); release() drops them
        self.weights = DecodeWeights(model)
        self.keeps_between_rollouts = True  # the static batch and the decode weights; release() may turn it off
        self.max_rows = spec.max_rows  # halved where a rollout runs out of memory (within_memory)

    def respec(self, spec, afresh):
        """Run as `spec` from the next rollout on, its rows the spec's again; afresh: what is kept goes (release)."""
        if afresh:
            self.release()
        self.spec, self.max_rows = spec, spec.max_rows

    @property
    def kept_batch(self):
        """The static batch kept last (by the last rollout that ran to its end), or None."""
        return self.kept.latest

    def release(self, keep_from_now_on=True):
        """Drop what is kept between rollouts: the static batch (its KV cache and CUDA graphs, captured over the
        decode weights) and the decode weights, e.g. to give their memory to training after an out-of-memory.
        With keep_from_now_on=False later rollouts free theirs when they end. True if anything was held."""
        held = self.drop_kept_batches() > 0 or bool(self.weights.copies) or bool(self.weights.fused)
        self.weights.clear()
        self.keeps_between_rollouts = keep_from_now_on
        return held

    def drop_kept_batches(self, keep_latest=False):
        """Drop the static batches kept from earlier rollouts (not the decode weights), all of them or all but the
        latest (in chat_rl's training, the step's own: an eval's goes), e.g. after an out-of-memory. Returns how
        many it dropped."""
        return self.kept.drop(keep_latest)

    def yield_memory(self):
        """Give memory to other work that ran out of it (chat_rl's training, before it retries): first the batches
        kept from other rollouts (an eval's), the latest rollout's staying; at the next call that one and the decode
        weights, and later rollouts keep none (rebuilding them each rollout costs less than running short of memory
        each step). What it gave back, in words, or None if it held nothing."""
        dropped = self.drop_kept_batches(keep_latest=True)
        if dropped:
            return f"the {dropped} decode batch(es) the rollout engine keeps from other rollouts (an eval's)"
        if self.release(keep_from_now_on=False):
            return ("the KV cache, decode graphs and weights the rollout engine keeps between rollouts (it keeps none "
                    "from now on)")
        return None

    def within_memory(self, rollout, progress, last_stats):
        """rollout(rows, progress), a rollout of this engine capped at its rows (max_rows; None: what the budget
        holds) that calls progress(n) as rows finish, retried where it runs out of memory: first once the batches
        kept from other rollouts are given back (the same rows), then with half the rows the failed rollout held
        (last_stats(), its RolloutStats) until one row fails too, each retry's line printed (nanochat.runtime.device's
        with_fewer_rows_on_oom); a retry takes back the rows progress counted (CountedProgress). Halved, the rows stay
        so for later rollouts (max_rows). What a rollout samples does not depend on its rows (per-row sampling
        streams). Returns rollout()'s result."""
        counted, rows = CountedProgress(progress) if progress is not None else None, self.max_rows

        def attempt(cap):
            if cap != rows:  # halved
                self.max_rows = cap
            if counted is not None:
                counted.restart()
            return rollout(cap, counted)

        def give_back_kept_batches():  # an eval's batch kept beside the steps' (Engine._new_batch), or theirs beside it
            dropped = self.drop_kept_batches()
            return GAVE_BACK_LINE.format(dropped=dropped) if dropped else None
        result, _ = with_fewer_rows_on_oom(attempt, rows, FEWER_ROWS_LINE, free_memory=give_back_kept_batches,
                                           rows_in_use=lambda: max(last_stats().rows_allocated,
                                                                   last_stats().max_batch_rows))
        return result

    def batch_for(self, shape_of, limit, samples):
        """Where a rollout's batch comes from, `shape_of(rows)` being the shape it has with that many rows (its
        prompts' capacity, completion cap, samples per prompt and dtype the same whatever the rows): (a kept batch
        that serves it, taken out of those kept; its rows), or (None; the rows of a new one beside the batches kept,
        see KeptBatches.rows_beside). The kept batches for shorter prompts, which no rollout can use again, go first.
        limit: the rows it may take at most (None: what the budget holds); samples: the rows it has to sample."""
        shape = shape_of(1)
        self.kept.forget_shorter(shape.prompt_cap)
        kept = self.kept.take(shape_of, limit, samples)
        if kept is not None:
            return kept, kept.shape.rows
        in_budget = partial(self.rows_for_budget, shape.prompt_cap, shape.max_tokens, shape.dtype, shape.num_samples)
        return None, self.kept.rows_beside(self.spec.memory_budget_gb * (1 << 30), limit, samples, in_budget)

    def rows_for_budget(self, prompt_len, max_tokens, dtype, num_samples=1, budget_bytes=None, at_least=1):
        """How many rows' KV cache fit in the memory budget (or in budget_bytes), and at least `at_least` (1: a
        rollout runs with one row whatever the budget; 0: what truly fits), see rows_in_budget. The budget is the
        KV caches': bf16 decode weights (DecodeWeights) come on top."""
        budget_bytes = self.spec.memory_budget_gb * (1 << 30) if budget_bytes is None else budget_bytes
        return rows_in_budget(cache_geometry(self.model).bytes_per_token(dtype), budget_bytes, prompt_len, max_tokens,
                              num_samples, share_prompts=self.spec.share_prompts, at_least=at_least)
