"""
The batched rollout engine: the API the scripts use (nanochat's generate / generate_batch, and generate_many for
rollouts), built from rooms of its own:

- nanochat/engine/rows.py: one sample in flight (Row, Completion) and the calculator tool's protocol;
- nanochat/engine/decode_batch.py: the rows decoded together (prefill, admit, the static step, retire);
- nanochat/engine/scheduler.py: the static batches kept between rollouts, a rollout's prompts on their way in, and
  the prompt slots that hold them (PromptPool);
- nanochat/engine/kv_cache.py, nanochat/engine/shared_prompt_cache.py: the caches behind one interface (RolloutCache);
- nanochat/model/attention.py: the contract between the model and a cache (CacheStep);
- nanochat/engine/cuda_graphs.py: the step's shapes, its CUDA graphs and the decode modes;
- nanochat/engine/decode_weights.py: bf16/fp16 copies of the matmul weights, made once per rollout;
- nanochat/engine/spec.py: what an Engine is built from (RolloutSpec), resolved once, and its memory budget;
- nanochat/engine/decode_steps.py: the decode steps it can run (torch, flex, triton), by name.

The engine owns its memory (RolloutMemory, below): the batches and weights it keeps between rollouts, what it gives
back when training runs short (yield_memory), and its rows halved where a rollout runs out (run_within_memory).

The engine knows nothing about text beyond the special-token ids it needs for the tool state machine:
token ids in, token ids and masks out. Sampling (per-row random streams) is nanochat/model/sampling.py.
"""

import math
from functools import partial

import torch

from nanochat.compiling.functions import maybe_compiled
from nanochat.engine.calculator import DEFAULT_FORMAT
from nanochat.engine.cuda_graphs import PROMPT_BUCKET, decode_plan
from nanochat.engine.decode_batch import DecodeBatch, RolloutStats, prepare_shapes
from nanochat.engine.decode_steps import AUTO, decode_step_of
from nanochat.engine.decode_weights import DecodeWeights
from nanochat.engine.kv_cache import KVCache, cache_geometry
from nanochat.engine.rows import Row, SpecialIds
from nanochat.engine.scheduler import PREFILL_TOKENS, Admission, BatchShape, KeptBatch, KeptBatches, cache_bytes
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.engine.spec import FIXED_GB, resolve_rollout_spec
from nanochat.runtime.device import with_fewer_rows_on_oom

# The static decode step compiles with dynamic shapes: one graph serves every bucketed
# shape. Compiled once per shape instead, each of a static batch's 100+ shapes would cost a compile of its own
# (seconds each on a CPU), most of them in the run's first rollout.
STATIC_STEP_DYNAMIC = True
# what a batch is made and decoded with: a spec that changes one of them starts the engine afresh (Engine.reconfigure)
STEP_FIELDS = ("decode", "compiled", "compile_required", "share_prompts", "decode_kernels")


def prompt_slots(rows, num_samples, num_prompts):
    """Prompts held at once with shared prompts: the ones the rows are on, plus room for prompts whose last rows
    are still running while the next ones start."""
    return max(1, min(num_prompts, 2 * math.ceil(rows / num_samples) + 1))


def autocast_dtype(device):
    """The dtype autocast runs matmuls in on `device` now; None outside autocast."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def decode_step_function(model, spec):
    """The static decode step the batches of an engine of RolloutSpec `spec` run: its decode step's (decode_steps.py),
    compiled where spec.compiled (a failure to compile it an error where spec.compile_required); a one-line
    DecodeKernelsError where it cannot run `model` on its device."""
    step = decode_step_of(spec.decode_kernels)
    step.check_runs(model)
    if not step.compiles:  # the spec refuses it compiled
        return step.static_step
    return maybe_compiled(step.static_step, spec.compiled, dynamic=STATIC_STEP_DYNAMIC, required=spec.compile_required)


def make_batch(model, shape, plan, stats, weights, step, decode_kernels="torch"):
    """An empty DecodeBatch of `shape` running the DecodePlan `plan` with the static step `step` (compiled or not);
    a static one's shapes prepared. decode_kernels: the decode step (decode_steps.py) whose per-step object a
    shared-prompt cache makes."""
    if shape.prompt_slots is not None:
        cache = SharedPromptKVCache.for_model(model, shape.rows, shape.prompt_slots, shape.prompt_cap, shape.max_tokens,
                                              shape.num_samples, shape.dtype, static=plan.static,
                                              step_class=decode_step_of(decode_kernels).cache_step)
    else:
        cache = KVCache.for_model(model, shape.rows, shape.prompt_cap + shape.max_tokens, shape.dtype,
                                  spare_positions=1 if plan.static else 0)
    batch = DecodeBatch(model, cache, shape.temperature, shape.top_k, stats, plan.shape, plan.graphs, weights, step)
    if plan.static:
        prepare_shapes(batch)
    return batch


def rows_in_budget(bytes_per_token, budget_bytes, prompt_len, max_tokens, num_samples, share_prompts, at_least):
    """How many rows' KV cache fit in `budget_bytes` (and at least `at_least`): prompt + completion per row, or with
    shared prompts a completion per row plus the prompt pool (about 2 prompts per num_samples rows, see
    prompt_slots)."""
    budget_tokens = max(0.0, budget_bytes / bytes_per_token)
    if not share_prompts:
        return max(at_least, int(budget_tokens // (prompt_len + max_tokens)))
    return max(at_least, int((budget_tokens - prompt_len) // (max_tokens + 2 * prompt_len / num_samples)))


def check_rollout_arguments(prompts, num_samples, temperature):
    """A ValueError naming what is wrong with a rollout's arguments, before anything is allocated for it."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (render_for_completion starts with <|bos|>)")


class NanochatGenerate:
    """nanochat's one-prompt API (generate, generate_batch), over the engine's batched rollout (_rollout,
    generate_many)."""

    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """Yield (token_column, token_masks) per step, one entry per row. A row that has ended keeps
        appearing as <|assistant_end|> with mask 0 until all rows end (nanochat keeps sampling them). No lag: a row
        admitted while others run (more samples than rows) would skip a column."""
        pad = self.special.assistant_end
        for events in self._rollout([list(tokens)], num_samples, max_tokens, temperature, top_k, [seed], lag=False):
            column, masks = [pad] * num_samples, [0] * num_samples
            for row, token, mask in events:
                column[row.sample], masks[row.sample] = token, mask
            yield column, masks

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """(results, masks): per row, prompt + generated tokens (terminal token excluded), and masks
        (0 for the prompt, then 1 sampled / 0 forced)."""
        completions = self.generate_many([tokens], num_samples=num_samples, **kwargs)[0]
        results = [list(tokens) + c.tokens for c in completions]
        masks = [[0] * len(tokens) + c.masks for c in completions]
        return results, masks


class RolloutMemory:
    """The memory an Engine holds, and how it gives it back: the static batches it keeps between rollouts
    (self.kept), its decode weights (self.weights), whether it keeps them at all (self.keeps_between_rollouts), and
    the rows a rollout decodes at once at most (self.max_rows: its spec's, halved where a rollout runs out of memory).
    Nothing outside the engine writes them: a run asks through these methods."""

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

    def run_within_memory(self, rollout, retry_line):
        """rollout() (rollouts of this engine: a chat_rl step's), retried where it runs out of memory: first once the
        batches kept from other rollouts are given back (the same rows), then with half the rows the failed rollout
        held (retry_line, formatted with them, printed) until one row fails too (nanochat.runtime.device's
        with_fewer_rows_on_oom). The rows stay halved for later rollouts. What a rollout samples does not depend on
        its rows (per-row sampling streams). Returns rollout()'s result."""
        def attempt(rows):
            self.max_rows = rows
            return rollout()

        def give_back_kept_batches():  # an eval's batch kept beside the steps' (Engine._new_batch), or theirs beside it
            dropped = self.drop_kept_batches()
            return (f"out of memory during rollouts: gave back the {dropped} decode batch(es) kept from other "
                    "rollouts; retrying") if dropped else None
        result, _ = with_fewer_rows_on_oom(
            attempt, self.max_rows, retry_line, free_memory=give_back_kept_batches,
            rows_in_use=lambda: max(self.last_stats.rows_allocated, self.last_stats.max_batch_rows))
        return result

    def rows_for_budget(self, prompt_len, max_tokens, dtype, num_samples=1, budget_bytes=None, at_least=1):
        """How many rows' KV cache fit in the memory budget (or in budget_bytes), and at least `at_least` (1: a
        rollout runs with one row whatever the budget; 0: what truly fits), see rows_in_budget. The budget is the
        KV caches': bf16 decode weights (DecodeWeights) come on top."""
        budget_bytes = self.spec.memory_budget_gb * (1 << 30) if budget_bytes is None else budget_bytes
        return rows_in_budget(cache_geometry(self.model).bytes_per_token(dtype), budget_bytes, prompt_len, max_tokens,
                              num_samples, self.spec.share_prompts, at_least)


class Engine(NanochatGenerate, RolloutMemory):
    """KV-cached sampling with the calculator tool.

    `generate`/`generate_batch` are nanochat's one-prompt API. `generate_many` is the batched rollout API:
    many prompts, `num_samples` rows each, decoded together in one KV-cached batch of at most `max_rows`
    rows; each prompt is prefilled once; finished rows leave the batch at once and waiting rows take their
    place. With share_prompts (the default) a prompt's keys and values are stored once for all its rows
    (SharedPromptKVCache: more rows fit, fewer bytes read per token); without, each row holds a copy, as
    nanochat does. Row r of a prompt with seed s samples with its own stream row_seed(s, r), so its output
    does not depend on the batch it shares. Under bf16/fp16 autocast (its spec's dtype, else its caller's) the
    forwards use the matmul weights cast once per rollout (DecodeWeights). The keywords are nanochat's and
    RolloutSpec's fields as resolve_rollout_spec takes them (spec.py: compile, a compiling/plan.py mode or
    True/False, whether the static decode step runs compiled, with dynamic shapes: STATIC_STEP_DYNAMIC; decode_kernels,
    the decode step, auto or a name of decode_steps.py's table); `spec`, a RolloutSpec resolved already (a run's
    plan's), takes their place. What the engine holds between rollouts is RolloutMemory's.
    """

    def __init__(self, model, tokenizer, max_rows=None, memory_budget_gb=FIXED_GB, share_prompts=True, decode="auto",
                 compile="off", prefill_tokens=PREFILL_TOKENS, lag=None, calculator_format=DEFAULT_FORMAT,
                 decode_kernels=AUTO, dtype=None, spec=None):
        self.model, self.tokenizer, self.special = model, tokenizer, SpecialIds(tokenizer)
        self.spec = spec or resolve_rollout_spec(  # an unusable setting fails here, not at a rollout
            model.get_device(), decode, compile, lag, max_rows=max_rows, memory_budget_gb=memory_budget_gb,
            share_prompts=share_prompts, decode_kernels=decode_kernels, calculator_format=calculator_format,
            prefill_tokens=prefill_tokens, dtype=dtype)
        self.step = self.decode_step_for(self.spec)
        self.max_rows = self.spec.max_rows  # halved where a rollout runs out of memory (run_within_memory)
        self.kept = KeptBatches()  # between rollouts (see _new_batch); release() drops them
        self.prompt_floor = 0  # static batches are sized for prompts this long at least (it never shrinks)
        self.keeps_between_rollouts = True  # the static batch and the decode weights; release() may turn it off
        self.weights = DecodeWeights(model)
        self.last_stats = RolloutStats()

    def decode_step_for(self, spec):  # the static decode step of `spec` (a benchmark's wrapper's engine: its own)
        return decode_step_function(self.model, spec)

    def reconfigure(self, spec):
        """Run the next rollouts as RolloutSpec `spec` says (a run's new spec, once --compile=auto switched its decode
        step; a benchmark's other prefill). Where it makes or decodes batches otherwise (STEP_FIELDS), what the engine
        keeps goes and it starts afresh, as a new engine of the spec would (the prompts it is sized for stay); else
        its batches serve on. Its rows are the spec's again."""
        if any(getattr(spec, name) != getattr(self.spec, name) for name in STEP_FIELDS):
            self.release()
            self.step, self.last_stats = self.decode_step_for(spec), RolloutStats()
        self.spec, self.max_rows = spec, spec.max_rows

    def reserve_prompt_length(self, length):
        """Size static batches for prompts of up to `length` tokens from now on (e.g. a task's longest), so that a
        run's batch, and its captured graphs, serve every rollout instead of being rebuilt when a longer prompt
        comes."""
        self.prompt_floor = max(self.prompt_floor, length)

    @property
    def kept_batch(self):
        """The static batch kept last (by the last rollout that ran to its end), or None."""
        return self.kept.latest

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42,
                      seeds=None, max_rows=None, progress=None):
        """Sample `num_samples` completions for each prompt. Returns a list (per prompt) of lists (per
        sample) of Completion. `seeds[i]` seeds prompt i (default: seed + i). `progress(n)`, if given, is
        called with the number of rows that just finished (e.g. a progress bar's update)."""
        seeds = [seed + i for i in range(len(prompts))] if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        results = [[None] * num_samples for _ in prompts]
        for events in self._rollout([list(p) for p in prompts], num_samples, max_tokens, temperature, top_k, seeds,
                                    max_rows=max_rows):
            finished = [row for row, _, _ in events if row.finished]
            for row in finished:
                results[row.request][row.sample] = row.out
            if finished and progress is not None:
                progress(len(finished))
        return results

    def _new_batch(self, num_prompts, longest, num_samples, max_tokens, temperature, top_k, max_rows):
        """An empty DecodeBatch: max_rows rows (else the engine's, else what the memory budget holds beside the
        batches kept, see KeptBatches.rows_beside), at most one per sample of every prompt, with a cache for prompts of
        up to `longest` tokens.

        A static batch (static and graph modes) has a shape fixed for the run: its prompts' capacity is the longest
        prompt seen or reserved (prompt_floor) rounded up to PROMPT_BUCKET positions, never less, and its rows are
        what the budget holds at that capacity. It is kept after a rollout that ran to its end and serves the next
        one of the same shape (see serves), so its cache and its CUDA graphs (all captured when it is made) are made
        once per run, not once per rollout; up to KEEP_BATCHES shapes are kept at once. Returns (the batch, its
        KeptBatch to keep once the rollout ends; None: not to be kept)."""
        dtype = autocast_dtype(self.model.get_device()) or cache_geometry(self.model).dtype
        plan = decode_plan(self.spec.decode)
        if plan.static:
            self.prompt_floor = max(self.prompt_floor, longest)
            longest = -(-self.prompt_floor // PROMPT_BUCKET) * PROMPT_BUCKET
        samples, limit = num_prompts * num_samples, max_rows or self.max_rows

        def shape_of(rows):
            return BatchShape(rows, prompt_slots(rows, num_samples, num_prompts) if self.spec.share_prompts else None,
                              longest, max_tokens, num_samples, dtype, temperature, top_k)

        self.kept.forget_shorter(longest)
        kept = self.kept.take(shape_of, limit, samples)
        if kept is not None:
            self.last_stats = RolloutStats(rows_allocated=kept.shape.rows)
            kept.batch.begin_rollout(self.last_stats)
            return kept.batch, kept
        rows = self.kept.rows_beside(self.spec.memory_budget_gb * (1 << 30), limit, samples,
                                     partial(self.rows_for_budget, longest, max_tokens, dtype, num_samples))
        shape = shape_of(rows)
        self.last_stats = RolloutStats(rows_allocated=rows)
        batch = make_batch(self.model, shape, plan, self.last_stats, self.weights, self.step,
                           self.spec.decode_kernels)
        keep = KeptBatch(shape, batch, cache_bytes(batch.cache), not limit and rows < samples) if plan.static else None
        return batch, keep

    def _rollout(self, prompts, num_samples, max_tokens, temperature, top_k, seeds, max_rows=None, lag=None):
        """The decode loop every API adapts (_decode_loop), each of its steps run under the spec's autocast
        (RolloutSpec.autocast), entered step by step: between steps the caller runs under its own."""
        steps = self._decode_loop(prompts, num_samples, max_tokens, temperature, top_k, seeds, max_rows, lag)
        precision = self.spec.autocast(self.model.get_device())  # made once, entered at every step
        while True:
            with precision:
                events = next(steps, None)
            if events is None:
                return
            yield events

    @torch.no_grad()
    def _decode_loop(self, prompts, num_samples, max_tokens, temperature, top_k, seeds, max_rows, lag):
        """Yields, per step, the events [(row, token, mask)] of the rows that emitted a token; a row whose `finished`
        is set has just left the batch (once). lag: None: the engine's."""
        check_rollout_arguments(prompts, num_samples, temperature)
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = max(1, self.model.config.sequence_len - longest)
        # the trainer has changed the weights since the last rollout
        self.weights.refresh(autocast_dtype(self.model.get_device()))
        batch, keep = self._new_batch(len(prompts), longest, num_samples, max_tokens, temperature, top_k, max_rows)
        batch.lag = self.spec.lag if lag is None else lag  # a kept batch ends each rollout with every row fed
        admission = Admission(prompts, seeds, num_samples,
                              partial(Row, max_tokens=max_tokens, special=self.special, tokenizer=self.tokenizer,
                                      calculator_format=self.spec.calculator_format),
                              self.spec.prefill_tokens)
        while batch.in_flight or admission.open:
            events = batch.decode_step()
            events += admission.admit(batch)
            if events:
                yield events
        if not self.keeps_between_rollouts:
            self.weights.clear()
        elif keep is not None:  # every row retired and every prompt slot freed: ready for the next rollout
            self.kept.keep(keep)

