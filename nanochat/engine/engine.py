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
- nanochat/engine/memory.py: the memory it holds (RolloutMemory, engine.memory): the batches and weights it keeps
  between rollouts, what it gives back when training runs short (yield_memory), and its rows halved where one of
  its rollouts runs out (within_memory, which generate_many(within_memory=True) runs: chat_rl's steps);
- nanochat/engine/decode_steps.py: the decode steps it can run (torch, flex, triton), by name.

The engine knows nothing about text beyond the special-token ids it needs for the tool state machine:
token ids in, token ids and masks out. Sampling (per-row random streams) is nanochat/model/sampling.py.
"""

import math
from functools import partial

import torch

from nanochat.compiling.functions import maybe_compiled
from nanochat.engine.cuda_graphs import PROMPT_BUCKET, decode_plan
from nanochat.engine.decode_batch import DecodeBatch, RolloutStats, prepare_shapes
from nanochat.engine.decode_steps import decode_step_of
from nanochat.engine.kv_cache import KVCache, cache_geometry
from nanochat.engine.memory import RolloutMemory
from nanochat.engine.rows import Row, SpecialIds
from nanochat.engine.scheduler import Admission, BatchShape, KeptBatch, cache_bytes
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.engine.spec import rollout_spec

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
                                              rows_per_slot=shape.num_samples, dtype=shape.dtype, static=plan.static,
                                              step_class=decode_step_of(decode_kernels).cache_step)
    else:
        cache = KVCache.for_model(model, shape.rows, shape.prompt_cap + shape.max_tokens, shape.dtype,
                                  spare_positions=1 if plan.static else 0)
    batch = DecodeBatch(model, cache, shape.temperature, shape.top_k, stats, shape=plan.shape, graphs=plan.graphs,
                        weights=weights, step=step)
    if plan.static:
        prepare_shapes(batch)
    return batch


def check_rollout_arguments(prompts, num_samples, temperature):
    """A ValueError naming what is wrong with a rollout's arguments, before anything is allocated for it."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (render_for_completion starts with <|bos|>)")


class Engine:
    """KV-cached sampling with the calculator tool, run as a RolloutSpec says (spec.py's rollout_spec resolves a
    script's settings; default: the defaults on the model's device). `generate`/`generate_batch` are nanochat's
    one-prompt API; `generate_many` the batched rollouts: many prompts, `num_samples` rows each, decoded together in
    one KV-cached batch (finished rows leave it at once for waiting ones), each prompt prefilled once and, with
    share_prompts, its keys and values stored once for all its rows. Row r of a prompt seeded s samples with its own
    stream row_seed(s, r): its output does not depend on the batch. Its memory is its RolloutMemory's (memory.py)."""

    def __init__(self, model, tokenizer, spec=None):
        self.model, self.tokenizer, self.special = model, tokenizer, SpecialIds(tokenizer)
        self.spec = spec or rollout_spec(model)
        self.step = self.decode_step_for(self.spec)  # an unusable spec fails here, not at a rollout
        self.memory = RolloutMemory(model, self.spec)
        self.prompt_floor = 0  # static batches are sized for prompts this long at least (it never shrinks)
        self.last_stats = RolloutStats()

    def decode_step_for(self, spec):  # the static decode step of `spec` (a benchmark's wrapper's engine: its own)
        return decode_step_function(self.model, spec)

    def reconfigure(self, spec):
        """Run the next rollouts as RolloutSpec `spec` says (a run's, --compile=auto having switched its decode step;
        a benchmark's other prefill). Where it makes or decodes batches otherwise (STEP_FIELDS), what it keeps goes and
        it starts afresh as a new engine would (its prompt floor stays); else its batches serve on, the spec's rows."""
        afresh = any(getattr(spec, name) != getattr(self.spec, name) for name in STEP_FIELDS)
        self.memory.respec(spec, afresh)
        if afresh:
            self.step, self.last_stats = self.decode_step_for(spec), RolloutStats()
        self.spec = spec

    def reserve_prompt_length(self, length):
        """Size static batches for prompts of up to `length` tokens from now on (e.g. a task's longest), so that a run's
        batch, and its captured graphs, serve every rollout instead of being rebuilt when a longer prompt comes."""
        self.prompt_floor = max(self.prompt_floor, length)

    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """Yield (token_column, token_masks) per step, one entry per row. A row that has ended keeps appearing as
        <|assistant_end|> with mask 0 until all rows end (nanochat samples them on). No lag: a row admitted while
        others run (more samples than rows) would skip a column."""
        pad = self.special.assistant_end
        for events in self._rollout([list(tokens)], num_samples, max_tokens, temperature, top_k=top_k, seeds=[seed],
                                    lag=False):
            column, masks = [pad] * num_samples, [0] * num_samples
            for row, token, mask in events:
                column[row.sample], masks[row.sample] = token, mask
            yield column, masks

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """(results, masks): per row, prompt + generated tokens (terminal token excluded), and masks (0 for the
        prompt, then 1 sampled / 0 forced)."""
        completions = self.generate_many([tokens], num_samples=num_samples, **kwargs)[0]
        return [list(tokens) + c.tokens for c in completions], [[0] * len(tokens) + c.masks for c in completions]

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42,
                      seeds=None, max_rows=None, progress=None, within_memory=False):
        """Sample `num_samples` completions for each prompt: [prompt][sample] Completion. `seeds[i]` seeds prompt i
        (default: seed + i); progress(n), if given, is called as n rows finish. within_memory (chat_rl's steps, on the
        engine's own rows): retried where it runs out of memory (RolloutMemory.within_memory: the kept batches given
        back, then the rows halved, for later rollouts too), progress first called with minus the rows it counted."""
        seeds = [seed + i for i in range(len(prompts))] if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        rollout = partial(self._completions, prompts=prompts, num_samples=num_samples, max_tokens=max_tokens,
                          temperature=temperature, top_k=top_k, seeds=seeds)
        if not within_memory:
            return rollout(max_rows, progress)
        if max_rows is not None:  # the back-off halves the engine's own rows, for its later rollouts too
            raise ValueError("generate_many(within_memory=True) runs with the engine's rows; pass no max_rows")
        return self.memory.within_memory(rollout, progress, lambda: self.last_stats)

    def _completions(self, max_rows, progress, prompts, num_samples, max_tokens, temperature, top_k, seeds):
        """One rollout of generate_many's (max_rows: None, the engine's): [prompt][sample] Completion."""
        results = [[None] * num_samples for _ in prompts]
        for events in self._rollout([list(p) for p in prompts], num_samples, max_tokens, temperature, top_k,
                                    seeds=seeds, max_rows=max_rows):
            finished = [row for row, _, _ in events if row.finished]
            for row in finished:
                results[row.request][row.sample] = row.out
            if finished and progress is not None:
                progress(len(finished))
        return results

    def _new_batch(self, num_prompts, longest, num_samples, max_tokens, temperature, top_k, max_rows):
        """An empty DecodeBatch: max_rows rows (else the engine's, else what the memory budget holds beside the batches
        kept: RolloutMemory.batch_for), at most one per sample of every prompt, for prompts of up to `longest` tokens.

        A static batch (static and graph modes) has a shape fixed for the run: its prompts' capacity is the longest
        prompt seen or reserved (prompt_floor) rounded up to PROMPT_BUCKET positions, never less, and its rows are
        what the budget holds at that capacity. It is kept after a rollout that ran to its end and serves the next
        one of the same shape (see serves), so its cache and its CUDA graphs (all captured when it is made) are made
        once per run; up to KEEP_BATCHES shapes are kept at once. Returns (the batch, its KeptBatch to keep once the
        rollout ends; None: not to be kept)."""
        dtype = autocast_dtype(self.model.get_device()) or cache_geometry(self.model).dtype
        plan = decode_plan(self.spec.decode)
        if plan.static:
            self.prompt_floor = max(self.prompt_floor, longest)
            longest = -(-self.prompt_floor // PROMPT_BUCKET) * PROMPT_BUCKET
        samples, limit = num_prompts * num_samples, max_rows or self.memory.max_rows

        def shape_of(rows):
            return BatchShape(rows, prompt_slots(rows, num_samples, num_prompts) if self.spec.share_prompts else None,
                              longest, max_tokens, num_samples, dtype=dtype, temperature=temperature, top_k=top_k)

        kept, rows = self.memory.batch_for(shape_of, limit, samples)
        self.last_stats = RolloutStats(rows_allocated=rows)
        if kept is not None:
            kept.batch.begin_rollout(self.last_stats)
            return kept.batch, kept
        shape = shape_of(rows)
        batch = make_batch(self.model, shape, plan, self.last_stats, self.memory.weights, step=self.step,
                           decode_kernels=self.spec.decode_kernels)
        keep = KeptBatch(shape, batch, cache_bytes(batch.cache), not limit and rows < samples) if plan.static else None
        return batch, keep

    def _rollout(self, prompts, num_samples, max_tokens, temperature, top_k, seeds, max_rows=None, lag=None):
        """The decode loop every API adapts (_decode_loop), each of its steps run under the spec's autocast
        (RolloutSpec.autocast), entered step by step: between steps the caller runs under its own."""
        steps = self._decode_loop(prompts, num_samples, max_tokens, temperature, top_k, seeds=seeds, max_rows=max_rows,
                                  lag=lag)
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
        self.memory.weights.refresh(autocast_dtype(self.model.get_device()))  # the trainer has changed them since
        batch, keep = self._new_batch(len(prompts), longest, num_samples, max_tokens, temperature, top_k=top_k,
                                      max_rows=max_rows)
        batch.lag = self.spec.lag if lag is None else lag  # a kept batch ends each rollout with every row fed
        admission = Admission(prompts, seeds, num_samples,
                              partial(Row, max_tokens=max_tokens, special=self.special, tokenizer=self.tokenizer,
                                      calculator_format=self.spec.calculator_format), self.spec.prefill_tokens)
        while batch.in_flight or admission.open:
            events = batch.decode_step()
            events += admission.admit(batch)
            if events:
                yield events
        if not self.memory.keeps_between_rollouts:
            self.memory.weights.clear()
        elif keep is not None:  # every row retired and every prompt slot freed: ready for the next rollout
            self.memory.kept.keep(keep)

