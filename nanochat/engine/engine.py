"""
The batched rollout engine: the API the scripts use (nanochat's generate / generate_batch, and generate_many for
rollouts), built from rooms of its own:

- nanochat/engine/rows.py: one sample in flight (Row, Completion) and the calculator tool's protocol;
- nanochat/engine/decode_batch.py: the rows decoded together (admit, the static step, retire) and the prompt pool;
- nanochat/engine/scheduler.py: the static batches kept between rollouts, and a rollout's prompts on their way in;
- nanochat/engine/kv_cache.py, nanochat/engine/shared_prompt_cache.py: the caches behind one interface (RolloutCache);
- nanochat/model/attention.py: the contract between the model and a cache (CacheStep);
- nanochat/engine/cuda_graphs.py: the step's shapes, its CUDA graphs and the decode modes;
- nanochat/engine/decode_weights.py: bf16/fp16 copies of the matmul weights, made once per rollout.

The engine knows nothing about text beyond the special-token ids it needs for the tool state machine:
token ids in, token ids and masks out. Sampling (per-row random streams) is nanochat/model/sampling.py.
"""

import math
from functools import partial

import torch

from nanochat.compiling.functions import maybe_compiled
from nanochat.compiling.plan import compile_plan
from nanochat.engine.calculator import CALCULATOR_FORMATS, DEFAULT_FORMAT
from nanochat.engine.cuda_graphs import PROMPT_BUCKET, decode_mode, decode_plan
from nanochat.engine.decode_batch import PREFILL_TOKENS, DecodeBatch, RolloutStats, prepare_shapes, static_step
from nanochat.engine.decode_weights import DecodeWeights
from nanochat.engine.flex_prompt_attention import check_prompt_attention
from nanochat.engine.kv_cache import KVCache, cache_geometry
from nanochat.engine.memory_budget import FIXED_GB
from nanochat.engine.rows import Row, SpecialIds
from nanochat.engine.scheduler import Admission, BatchShape, KeptBatch, KeptBatches, cache_bytes
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.kernels.decode_step import check_kernel_model, kernel_static_step
from nanochat.kernels.launch import check_kernels

# The static decode step compiles with dynamic shapes: one graph serves every bucketed
# shape. Compiled once per shape instead, each of a static batch's 100+ shapes would cost a compile of its own
# (seconds each on a CPU), most of them in the run's first rollout.
STATIC_STEP_DYNAMIC = True
def prompt_slots(rows, num_samples, num_prompts):
    """Prompts held at once with shared prompts: the ones the rows are on, plus room for prompts whose last rows
    are still running while the next ones start."""
    return max(1, min(num_prompts, 2 * math.ceil(rows / num_samples) + 1))


def autocast_dtype(device):
    """The dtype autocast runs matmuls in on `device` now; None outside autocast."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def decode_step_function(model, compile, compiles, prompt_attention):
    """The static decode step an engine's batches run: static_step, compiled where `compiles`; or with prompt
    attention "triton" the kernels' step (never compiled: its kernels are the fusion), or a one-line ValueError where
    it cannot run."""
    if prompt_attention != "triton":
        return maybe_compiled(static_step, compiles, dynamic=STATIC_STEP_DYNAMIC, required=compile == "on")
    check_kernels(model.get_device())
    check_kernel_model(model)
    if compile is True or compile == "on":
        raise ValueError("prompt attention triton is not compiled (its kernels are the fusion): use compile off or auto")
    return kernel_static_step


def make_batch(model, shape, plan, stats, weights, step, prompt_attention="explicit"):
    """An empty DecodeBatch of `shape` running the DecodePlan `plan` with the static step `step` (compiled or not);
    a static one's shapes prepared. prompt_attention: a shared-prompt cache's (SharedPromptKVCache's attention)."""
    if shape.prompt_slots is not None:
        cache = SharedPromptKVCache.for_model(model, shape.rows, shape.prompt_slots, shape.prompt_cap, shape.max_tokens,
                                              shape.num_samples, shape.dtype, static=plan.static, attention=prompt_attention)
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


def check_calculator_format(style):
    if style not in CALCULATOR_FORMATS:
        raise ValueError(f"calculator_format must be one of {', '.join(CALCULATOR_FORMATS)}, got {style!r}")
    return style


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


class Engine(NanochatGenerate):
    """KV-cached sampling with the calculator tool.

    `generate`/`generate_batch` are nanochat's one-prompt API. `generate_many` is the batched rollout API:
    many prompts, `num_samples` rows each, decoded together in one KV-cached batch of at most `max_rows`
    rows; each prompt is prefilled once; finished rows leave the batch at once and waiting rows take their
    place. With share_prompts (the default) a prompt's keys and values are stored once for all its rows
    (SharedPromptKVCache: more rows fit, fewer bytes read per token); without, each row holds a copy, as
    nanochat does. Row r of a prompt with seed s samples with its own stream row_seed(s, r), so its output
    does not depend on the batch it shares. Under bf16/fp16 autocast the forwards use the matmul weights cast once
    per rollout (DecodeWeights). compile (compiling/plan.py's modes, or True/False): whether the static decode
    step runs compiled (static and graph decode modes only; in graph mode the engine's CUDA graphs capture the
    compiled step), with dynamic shapes (STATIC_STEP_DYNAMIC). prefill_tokens: positions one prefill forward takes at
    most (several prompts, padded to the longest; 1: one prompt at a time). lag: the host one step behind the device,
    the same tokens (DecodeBatch.decode_step); None: on CUDA (a CPU is its own device: nothing to overlap).
    calculator_format: how a tool result is written ("str", nanochat's; "int": calculator.format_result).
    prompt_attention: the shared-prompt step's, "explicit", "flex" (flex_prompt_attention.py) or "triton" (kernels/).
    """

    def __init__(self, model, tokenizer, max_rows=None, memory_budget_gb=FIXED_GB, share_prompts=True, decode="auto",
                 compile="off", prefill_tokens=PREFILL_TOKENS, lag=None, calculator_format=DEFAULT_FORMAT,
                 prompt_attention="explicit"):
        self.model, self.tokenizer, self.special = model, tokenizer, SpecialIds(tokenizer)
        self.max_rows, self.memory_budget_gb = max_rows, memory_budget_gb
        self.share_prompts, self.prefill_tokens = share_prompts, prefill_tokens
        self.calculator_format = check_calculator_format(calculator_format)
        self.prompt_attention = check_prompt_attention(prompt_attention, share_prompts)
        self.lag = model.get_device().type == "cuda" if lag is None else lag
        self.decode = decode_mode(decode, model.get_device())  # an unusable mode fails here, not at a rollout
        compiles = compile if isinstance(compile, bool) else compile_plan(compile, model.get_device(), self.decode).decode
        self.step = decode_step_function(model, compile, compiles, self.prompt_attention)
        self.kept = KeptBatches()  # between rollouts (see _new_batch); release() drops them
        self.prompt_floor = 0  # static batches are sized for prompts this long at least (it never shrinks)
        self.keeps_between_rollouts = True  # the static batch and the decode weights; release() may turn it off
        self.weights = DecodeWeights(model)
        self.last_stats = RolloutStats()

    def reserve_prompt_length(self, length):
        """Size static batches for prompts of up to `length` tokens from now on (e.g. a task's longest), so that a
        run's batch, and its captured graphs, serve every rollout instead of being rebuilt when a longer prompt
        comes."""
        self.prompt_floor = max(self.prompt_floor, length)

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

    def rows_for_budget(self, prompt_len, max_tokens, dtype, num_samples=1, budget_bytes=None, at_least=1):
        """How many rows' KV cache fit in the memory budget (or in budget_bytes), and at least `at_least` (1: a
        rollout runs with one row whatever the budget; 0: what truly fits), see rows_in_budget. The budget is the
        KV caches': bf16 decode weights (DecodeWeights) come on top."""
        budget_bytes = self.memory_budget_gb * (1 << 30) if budget_bytes is None else budget_bytes
        return rows_in_budget(cache_geometry(self.model).bytes_per_token(dtype), budget_bytes, prompt_len, max_tokens,
                              num_samples, self.share_prompts, at_least)

    def _new_batch(self, num_prompts, longest, num_samples, max_tokens, temperature, top_k, max_rows):
        """An empty DecodeBatch: max_rows rows (else the engine's, else what the memory budget holds beside the
        batches kept, see rows_beside_kept), at most one per sample of every prompt, with a cache for prompts of up
        to `longest` tokens.

        A static batch (static and graph modes) has a shape fixed for the run: its prompts' capacity is the longest
        prompt seen or reserved (prompt_floor) rounded up to PROMPT_BUCKET positions, never less, and its rows are
        what the budget holds at that capacity. It is kept after a rollout that ran to its end and serves the next
        one of the same shape (see serves), so its cache and its CUDA graphs (all captured when it is made) are made
        once per run, not once per rollout; up to KEEP_BATCHES shapes are kept at once. Returns (the batch, its
        KeptBatch to keep once the rollout ends; None: not to be kept)."""
        dtype = autocast_dtype(self.model.get_device()) or cache_geometry(self.model).dtype
        plan = decode_plan(self.decode)
        if plan.static:
            self.prompt_floor = max(self.prompt_floor, longest)
            longest = -(-self.prompt_floor // PROMPT_BUCKET) * PROMPT_BUCKET
        samples, limit = num_prompts * num_samples, max_rows or self.max_rows

        def shape_of(rows):
            return BatchShape(rows, prompt_slots(rows, num_samples, num_prompts) if self.share_prompts else None,
                              longest, max_tokens, num_samples, dtype, temperature, top_k)

        self.kept.forget_shorter(longest)
        kept = self.kept.take(shape_of, limit, samples)
        if kept is not None:
            self.last_stats = RolloutStats(rows_allocated=kept.shape.rows)
            kept.batch.begin_rollout(self.last_stats)
            return kept.batch, kept
        rows = self.kept.rows_beside(self.memory_budget_gb * (1 << 30), limit, samples,
                                     partial(self.rows_for_budget, longest, max_tokens, dtype, num_samples))
        shape = shape_of(rows)
        self.last_stats = RolloutStats(rows_allocated=rows)
        batch = make_batch(self.model, shape, plan, self.last_stats, self.weights, self.step, self.prompt_attention)
        keep = KeptBatch(shape, batch, cache_bytes(batch.cache), not limit and rows < samples) if plan.static else None
        return batch, keep

    @torch.no_grad()
    def _rollout(self, prompts, num_samples, max_tokens, temperature, top_k, seeds, max_rows=None, lag=None):
        """The decode loop every API adapts. Yields, per step, the events [(row, token, mask)] of the rows
        that emitted a token; a row whose `finished` is set has just left the batch (once). lag: None: the engine's."""
        check_rollout_arguments(prompts, num_samples, temperature)
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = max(1, self.model.config.sequence_len - longest)
        # the trainer has changed the weights since the last rollout
        self.weights.refresh(autocast_dtype(self.model.get_device()))
        batch, keep = self._new_batch(len(prompts), longest, num_samples, max_tokens, temperature, top_k, max_rows)
        batch.lag = self.lag if lag is None else lag  # a kept batch ends each rollout with every row fed
        admission = Admission(prompts, seeds, num_samples,
                              partial(Row, max_tokens=max_tokens, special=self.special, tokenizer=self.tokenizer,
                                      calculator_format=self.calculator_format),
                              self.prefill_tokens)
        while batch.in_flight or admission.open:
            events = batch.decode_step()
            events += admission.admit(batch)
            if events:
                yield events
        if not self.keeps_between_rollouts:
            self.weights.clear()
        elif keep is not None:  # every row retired and every prompt slot freed: ready for the next rollout
            self.kept.keep(keep)

