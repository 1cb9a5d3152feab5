"""
Token-level inference: the KV caches, the per-row calculator tool state machine, and the batched rollout
engine. Sampling (per-row random streams) is nanochat/sampling.py.

The engine knows nothing about text beyond the special-token ids it needs for the tool state machine:
token ids in, token ids and masks out.

A rollout is three layers: a `Row` is one sample in flight (its Completion and tool state); a `DecodeBatch`
holds the rows being decoded, each in a slot of one KV cache; `Engine._rollout` prefills prompts, admits
their rows into free slots and steps the batch until every row has finished.

Under bf16 (or fp16) autocast the engine's forwards use copies of the matmul weights made in that dtype once per
rollout (`DecodeWeights`), not casts made at every step: the same numbers, a third of the weight traffic.
"""

import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from nanochat.calculator import format_result, use_calculator
from nanochat.gpt import attend, sequence_masks, window_mask
from nanochat.sampling import row_seeds, sample_with_logprobs


def cache_geometry(model):
    """What a KV cache for `model` needs to know: (n_kv_head, head_dim, n_layer, device, parameter dtype,
    embed_dim of the per-row smear state or None). A model without a `generation` (a test double) carries
    no smear state."""
    cfg = model.config
    smear = getattr(getattr(model, "generation", None), "smear", False)
    return (cfg.n_kv_head, cfg.n_embd // cfg.n_head, cfg.n_layer, model.get_device(), next(model.parameters()).dtype,
            cfg.n_embd if smear else None)


class KVCache:
    """Keys and values of every layer for B rows, each row at its own position.

    k, v: (n_layer, B, T_max, n_kv_head, head_dim)
    pos:  (B,) int64, how many tokens of each row are cached (rows may differ).
    active: (B,) int64, 1 for a row in use; a forward advances only those (a static-shape decode step runs
          every row of its bucket, and a free row must stay where it was: at 0).
    prev_embedding: (B, 1, embed_dim) or None: the normed embedding of each row's last cached token, for
          generations that smear it into the next position (zeros for an empty row: adds nothing).

    Contract with `GPT.forward(idx, kv_cache=cache)` for idx of shape (B, T): row b's new tokens sit at
    positions pos[b] .. pos[b]+T-1 (rotary uses these); each layer writes its k, v there and attends to
    the row's own cached positions (causal, and windowed for short-window layers); after the last layer
    the model calls `cache.advance(T)`. Entries past a row's position are never read unmasked, and the
    storage starts zeroed so masked entries are finite (0 * garbage must not make NaN).
    """

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers, device="cpu", dtype=torch.float32,
                 embed_dim=None, embed_dtype=torch.float32):
        shape = (num_layers, batch_size, seq_len, num_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.active = torch.ones(batch_size, dtype=torch.long, device=device)
        self.prev_embedding = (None if embed_dim is None else
                               torch.zeros(batch_size, 1, embed_dim, device=device, dtype=embed_dtype))
        self.known_keys = None  # keys the next forward reads, when the caller knows them (decode_view)

    @classmethod
    def for_model(cls, model, batch_size, seq_len, dtype=None):
        """An empty cache shaped for `model`, with the per-row state its generation carries between steps."""
        heads, head_dim, layers, device, param_dtype, embed_dim = cache_geometry(model)
        return cls(batch_size, heads, seq_len, head_dim, layers, device=device, dtype=dtype or param_dtype,
                   embed_dim=embed_dim, embed_dtype=param_dtype)

    @property
    def batch_size(self):
        return self.k.size(1)

    @property
    def max_seq_len(self):
        return self.k.size(2)

    def reset(self):
        self.pos.zero_()
        self.known_keys = None
        if self.prev_embedding is not None:
            self.prev_embedding.zero_()

    def get_pos(self):
        """The largest row position (equal to every row's position when rows move in lockstep)."""
        return int(self.pos.max())

    def advance(self, num_tokens):
        self.pos.add_(self.active, alpha=num_tokens)
        self.known_keys = None

    def next_positions(self):
        """(B,) the absolute position each row's next token takes."""
        return self.pos.clone()

    def decode_capacity(self):
        """Keys a decode step can read: the cache's positions."""
        return self.max_seq_len

    def decode_view(self, rows, keys, last_position=None):
        """The first `rows` rows for a single-token step whose attention reads keys 0..keys-1, which must cover
        every active row's keys, this step's included (the caller knows the rows' positions: nothing is read
        from the device; last_position, the largest, is checked by the caller)."""
        view = self.rows(0, rows)
        view.known_keys = keys
        return view

    @staticmethod
    def keys_read(rows, keys):
        """Key/value positions a decode step of decode_view(rows, keys) reads per layer."""
        return rows * keys

    def attention_plan(self, T, windows, max_positions):
        """For a forward of T tokens per row: their positions (B, T), the mask of each window over the keys
        0..Tk-1 every layer attends to, and the attention context (writes the new keys, reads the row's)."""
        Tk = int(self.pos.max()) + T if self.known_keys is None else self.known_keys  # a host sync if unknown
        if Tk > self.max_seq_len or Tk > max_positions:
            raise ValueError(f"KV cache overflow: {Tk} positions needed, the cache holds {self.max_seq_len} "
                             f"and the rotary tables {max_positions}")
        positions = self.pos[:, None] + torch.arange(T, device=self.pos.device)  # (B, T)
        if Tk == T:  # every row starts at 0 (a prefill): the uncached masks apply, causal kernels included
            masks = sequence_masks(T, windows, self.pos.device)
        else:
            masks = {w: window_mask(positions, Tk, w)[:, None] for w in set(windows)}  # (B, 1, T, Tk)
        return positions, masks, _CacheAttention(self, positions, Tk)

    def rows(self, start, stop):
        """A cache over rows [start, stop) that shares storage with this one (writes land here)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.pos = self.k[:, start:stop], self.v[:, start:stop], self.pos[start:stop]
        view.active = self.active[start:stop]
        view.prev_embedding = None if self.prev_embedding is None else self.prev_embedding[start:stop]
        view.known_keys = None
        return view

    def copy_rows(self, dst, src):
        """Row dst[i] becomes a copy of row src[i] (keys, values, position, smear state). dst, src: (N,) long."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.pos[dst] = self.pos[src]
        self.active[dst] = self.active[src]
        if self.prev_embedding is not None:
            self.prev_embedding[dst] = self.prev_embedding[src]

    def release_row(self, row):
        """Row `row` is free: it stays at position 0 and no forward moves it (its entries are never read)."""
        self.active[row] = 0
        self.pos[row] = 0

    def fill_rows_from(self, start, stop, prompt_cache):
        """Rows [start, stop) become copies of the single row of `prompt_cache` (a prefilled prompt)."""
        length = prompt_cache.max_seq_len
        self.k[:, start:stop, :length] = prompt_cache.k[:, 0:1]
        self.v[:, start:stop, :length] = prompt_cache.v[:, 0:1]
        self.pos[start:stop] = prompt_cache.pos[0]
        self.active[start:stop] = 1
        if self.prev_embedding is not None:
            self.prev_embedding[start:stop] = prompt_cache.prev_embedding[0:1]


class _CacheAttention:
    """A KV-cached forward's attention: each layer stores its new keys/values at the rows' positions and
    attends to the rows' cached keys 0..Tk-1 (the masks hide what a row does not have)."""

    def __init__(self, cache, positions, Tk):
        self.cache, self.positions, self.Tk = cache, positions, Tk  # positions: (B, T)
        self.rows = torch.arange(positions.size(0), device=positions.device)[:, None]  # (B, 1)

    def attend(self, layer_idx, q, k, v, mask):
        k_store, v_store = self.cache.k[layer_idx], self.cache.v[layer_idx]  # (B, T_max, Hkv, D)
        k_store[self.rows, self.positions] = k.to(k_store.dtype)
        v_store[self.rows, self.positions] = v.to(v_store.dtype)
        # attend in q's dtype: no copy when the cache has it
        return attend(q, k_store[:, :self.Tk].to(q.dtype), v_store[:, :self.Tk].to(q.dtype), mask)


class SharedPromptKVCache:
    """The KV cache of batched decoding when rows share prompts: each prompt's keys/values are stored once,
    in a pool slot, and each row stores only its own completion (its suffix).

    pool_k, pool_v: (n_layer, slots, n_kv_head, prompt_cap, head_dim); pool_len: (slots,) prompt lengths
    k, v:           (n_layer, B, n_kv_head, capacity, head_dim);     pos: (B,) suffix tokens cached
                    capacity grows on demand (doubling, up to suffix_cap), so rows that end early never pay
                    for max_tokens positions
    slot, sample:   (B,) the row's prompt slot and its index among that prompt's rows; a free row has sample
                    rows_per_slot: in a static cache, a spare column of the prompt attention's layout that no
                    row in use shares (a dynamic one never runs free rows)
    active:         (B,) 1 for a row in use, as in KVCache
    prev_embedding: (B, 1, embed_dim) or None, as in KVCache

    Only single-token decode steps run on it (prompts are prefilled into a one-row KVCache, then stored
    with `store_prompt`). A row's query at absolute position p = prompt length + pos attends to its prompt's
    keys and to its own suffix; both score sets go through one softmax, so the result is attention over the
    concatenation, exactly. The prompt's scores are computed per slot for all its rows at once: the prompt's
    keys and values are read once per step and layer, not once per row.
    """

    def __init__(self, batch_size, slots, prompt_cap, suffix_cap, num_heads, head_dim, num_layers, device="cpu",
                 dtype=torch.float32, rows_per_slot=1, embed_dim=None, embed_dtype=torch.float32, static=False):
        self.pool_k = torch.zeros(num_layers, slots, num_heads, prompt_cap, head_dim, device=device, dtype=dtype)
        self.pool_v = torch.zeros_like(self.pool_k)
        self.pool_len = torch.zeros(slots, dtype=torch.long, device=device)
        self.suffix_cap = suffix_cap
        # static: for decode steps over a fixed number of rows (free ones included) that may be captured: every
        # position is allocated now, so the storage never moves, and free rows get a spare sample column
        self.static = static
        capacity = suffix_cap if static else min(suffix_cap, self.INITIAL_SUFFIX_CAPACITY)
        self.k = torch.zeros(num_layers, batch_size, num_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slot = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.rows_per_slot = rows_per_slot  # the largest sample index + 1 (num_samples)
        self.sample = torch.full((batch_size,), rows_per_slot, dtype=torch.long, device=device)  # all rows free
        self.active = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.prev_embedding = (None if embed_dim is None else
                               torch.zeros(batch_size, 1, embed_dim, device=device, dtype=embed_dtype))
        self.known_keys = None  # (suffix keys, largest next position) the next forward reads, set by decode_view

    INITIAL_SUFFIX_CAPACITY = 64

    def ensure_suffix_capacity(self, needed):
        """Make room for `needed` suffix positions per row (grows by doubling; entries past a row's position
        stay zero, so masked keys are finite)."""
        capacity = self.k.size(3)
        if needed <= capacity:
            return
        if needed > self.suffix_cap:
            raise ValueError(f"KV cache overflow: {needed} completion positions needed, the cache holds {self.suffix_cap}")
        grown = min(self.suffix_cap, max(needed, 2 * capacity))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], grown, old.size(4))
            new[:, :, :, :capacity] = old
            setattr(self, name, new)

    @classmethod
    def for_model(cls, model, batch_size, slots, prompt_cap, suffix_cap, rows_per_slot, dtype=None, static=False):
        heads, head_dim, layers, device, param_dtype, embed_dim = cache_geometry(model)
        return cls(batch_size, slots, prompt_cap, suffix_cap, heads, head_dim, layers, device=device,
                   dtype=dtype or param_dtype, rows_per_slot=rows_per_slot, embed_dim=embed_dim, embed_dtype=param_dtype,
                   static=static)

    @staticmethod
    def bytes_per_token(model, dtype):
        """Bytes of keys and values one cached position takes over all layers."""
        heads, head_dim, layers, _, _, _ = cache_geometry(model)
        return 2 * layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def batch_size(self):
        return self.k.size(1)

    def store_prompt(self, slot, prompt_cache):
        """Pool slot `slot` holds the single row of `prompt_cache` (a prefilled KVCache) from now on."""
        length = int(prompt_cache.pos[0])
        if length > self.pool_k.size(3):
            raise ValueError(f"prompt of {length} tokens does not fit the pool's {self.pool_k.size(3)} positions")
        self.pool_k[:, slot, :, :length] = prompt_cache.k[:, 0, :length].transpose(1, 2)
        self.pool_v[:, slot, :, :length] = prompt_cache.v[:, 0, :length].transpose(1, 2)
        self.pool_len[slot] = length

    def admit_rows(self, start, stop, slot, first_sample, prompt_cache):
        """Rows [start, stop) begin as samples first_sample.. of the prompt in `slot` (stored from prompt_cache)."""
        self.pos[start:stop] = 0
        self.slot[start:stop] = slot
        self.sample[start:stop] = torch.arange(first_sample, first_sample + stop - start, device=self.pos.device)
        self.active[start:stop] = 1
        if self.prev_embedding is not None:
            self.prev_embedding[start:stop] = prompt_cache.prev_embedding[0:1]

    def copy_rows(self, dst, src):
        """Row dst[i] becomes a copy of row src[i]. dst, src: (N,) long."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        for t in (self.pos, self.slot, self.sample, self.active):
            t[dst] = t[src]
        if self.prev_embedding is not None:
            self.prev_embedding[dst] = self.prev_embedding[src]

    def release_row(self, row):
        """Row `row` is free: at position 0, in the spare sample column, and no forward moves it."""
        self.active[row] = 0
        self.pos[row] = 0
        self.slot[row] = 0
        self.sample[row] = self.rows_per_slot

    def rows(self, start, stop):
        """A cache over rows [start, stop) sharing this one's storage and pool (start must be 0: the active
        rows are a dense prefix)."""
        if start != 0:
            raise ValueError("SharedPromptKVCache.rows takes a prefix of the rows (start=0)")
        view = SharedPromptKVCache.__new__(SharedPromptKVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = self.k[:, :stop], self.v[:, :stop]
        view.pos, view.slot, view.sample, view.active = self.pos[:stop], self.slot[:stop], self.sample[:stop], self.active[:stop]
        view.suffix_cap = self.k.size(3)  # a view cannot grow: the base cache grows before views are taken
        view.prev_embedding = None if self.prev_embedding is None else self.prev_embedding[:stop]
        view.known_keys = None
        return view

    def advance(self, num_tokens):
        self.pos.add_(self.active, alpha=num_tokens)
        self.known_keys = None

    def next_positions(self):
        """(B,) the absolute position each row's next token takes: its prompt's length plus its completion's."""
        return self.pool_len[self.slot] + self.pos

    def decode_capacity(self):
        """Completion keys a decode step can read: all it may grow to."""
        return self.suffix_cap

    def decode_view(self, rows, keys, last_position):
        """The first `rows` rows for a single-token step whose attention reads keys 0..keys-1 of each row's
        completion (covering every active row's, this step's included) and whose largest position is
        last_position: the caller knows them, so nothing is read from the device. Grows the completion storage
        first when needed."""
        self.ensure_suffix_capacity(keys)
        view = self.rows(0, rows)  # after growing: a view cannot grow
        view.known_keys = (keys, last_position)
        return view

    def keys_read(self, rows, keys):
        """Key/value positions a decode step of decode_view(rows, keys) reads per layer: each pool slot's prompt
        once, and `keys` per row."""
        return self.pool_k.size(1) * self.pool_k.size(3) + rows * keys

    def attention_plan(self, T, windows, max_positions):
        if T != 1:
            raise ValueError(f"SharedPromptKVCache runs single-token decode steps only, got {T} tokens per row")
        if self.known_keys is None:  # one host sync
            top, last_position = torch.stack([self.pos.max(), self.next_positions().max()]).tolist()
            suffix_keys = top + 1
        else:
            suffix_keys, last_position = self.known_keys
        positions = self.next_positions()  # (B,)
        if suffix_keys > self.k.size(3) or last_position >= max_positions:
            raise ValueError(f"KV cache overflow: {suffix_keys} completion positions needed, the cache holds "
                             f"{self.k.size(3)}; or position {last_position} is past the rotary tables")
        return positions[:, None], {w: w for w in set(windows)}, _SharedPromptAttention(self, positions, suffix_keys)


class _SharedPromptAttention:
    """One decode step over a SharedPromptKVCache (see there); `mask` is the layer's window."""

    def __init__(self, cache, positions, suffix_keys):
        self.cache, self.positions, self.S = cache, positions, suffix_keys
        device = positions.device
        B = positions.size(0)
        self.row_index = torch.arange(B, device=device)
        prompt_len = cache.pool_len[cache.slot]  # (B,)
        self.prompt_keys = torch.arange(cache.pool_k.size(3), device=device)  # (Lp,)
        self.prompt_len, self.suffix_pos = prompt_len, cache.pos
        self.suffix_keys = torch.arange(suffix_keys, device=device)  # (S,)

    def attend(self, layer_idx, q, k, v, window):
        c = self.cache
        B, _, H, D = q.shape  # (B, 1, H, D)
        Hkv = k.size(2)
        rep = H // Hkv
        # store this step's key/value in each row's suffix
        c.k[layer_idx][self.row_index, :, self.suffix_pos] = k[:, 0].to(c.k.dtype)
        c.v[layer_idx][self.row_index, :, self.suffix_pos] = v[:, 0].to(c.v.dtype)
        q = q[:, 0].reshape(B, Hkv, rep, D)
        scale = 1.0 / math.sqrt(D)
        # prompt part: the queries of each slot's rows laid out as (slot, kv head, sample, rep) -> one matmul per
        # slot and kv head reads that prompt's keys once
        slots, G = c.pool_k.size(1), c.rows_per_slot + c.static  # + the spare column of free rows, if in the step
        grid = q.new_zeros(slots, Hkv, G, rep, D)
        grid[c.slot, :, c.sample] = q
        pool_k, pool_v = c.pool_k[layer_idx].to(q.dtype), c.pool_v[layer_idx].to(q.dtype)  # (slots, Hkv, Lp, D)
        prompt_scores = (grid.view(slots, Hkv, G * rep, D) @ pool_k.transpose(-1, -2)).view(slots, Hkv, G, rep, -1)
        prompt_scores = prompt_scores[c.slot, :, c.sample].float() * scale  # (B, Hkv, rep, Lp)
        query_pos = self.positions[:, None]  # (B, 1)
        prompt_visible = (self.prompt_keys < self.prompt_len[:, None]) & (query_pos - self.prompt_keys <= window)
        # own part: the row's completion so far, this step's token included
        suffix_k = c.k[layer_idx][:, :, :self.S].to(q.dtype)  # (B, Hkv, S, D)
        suffix_v = c.v[layer_idx][:, :, :self.S].to(q.dtype)
        suffix_scores = (q @ suffix_k.transpose(-1, -2)).float() * scale  # (B, Hkv, rep, S)
        delta = self.suffix_pos[:, None] - self.suffix_keys  # (B, S)
        suffix_visible = (delta >= 0) & (delta <= window)
        scores = torch.cat([prompt_scores.masked_fill(~prompt_visible[:, None, None], float("-inf")),
                            suffix_scores.masked_fill(~suffix_visible[:, None, None], float("-inf"))], dim=-1)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # one softmax over prompt and completion keys
        Lp = pool_k.size(2)
        prompt_probs = q.new_zeros(slots, Hkv, G, rep, Lp)
        prompt_probs[c.slot, :, c.sample] = probs[..., :Lp]
        prompt_out = (prompt_probs.view(slots, Hkv, G * rep, Lp) @ pool_v).view(slots, Hkv, G, rep, D)
        y = prompt_out[c.slot, :, c.sample] + probs[..., Lp:] @ suffix_v  # (B, Hkv, rep, D)
        return y.reshape(B, H, 1, D)


# -----------------------------------------------------------------------------
# One sample in flight: its Completion and the calculator tool's state machine


@dataclass
class Completion:
    """One sampled continuation of a prompt. tokens exclude the terminal token; masks: 1 = sampled by
    the model, 0 = forced by the tool (calculator output). Per token, the sampler's log-probabilities (nan for
    a forced token, see sampling.sample_with_logprobs): logprobs under the model at temperature 1 over the
    whole vocabulary (what the trainer computes), sampling_logprobs under the distribution sampled from."""
    tokens: list
    masks: list
    ended: bool = False        # True if the model emitted <|assistant_end|> or <|bos|>; False if cut at max_tokens
    tool_calls: int = 0        # <|python_end|> seen
    tool_successes: int = 0    # ... of which the calculator returned a value
    logprobs: list = field(default_factory=list)
    sampling_logprobs: list = field(default_factory=list)


class SpecialIds:
    """The ids of the special tokens the engine acts on."""

    def __init__(self, tokenizer):
        get = tokenizer.encode_special
        self.python_start, self.python_end = get("<|python_start|>"), get("<|python_end|>")
        self.output_start, self.output_end = get("<|output_start|>"), get("<|output_end|>")
        self.assistant_end, self.bos = get("<|assistant_end|>"), tokenizer.get_bos_token_id()
        self.terminal = {self.assistant_end, self.bos}  # a sampled one ends the row (not kept in its Completion)


class Row:
    """One sample of a prompt while it is decoded: the tool protocol lives here and nowhere else.

    Each step `feed` takes the token the model sampled and returns what the row emits. A sampled
    <|python_start|> expr <|python_end|> runs expr through the calculator; when it returns a value,
    <|output_start|> value <|output_end|> is queued and emitted over the next steps in place of the sampled
    tokens, with mask 0. <|assistant_end|> or <|bos|> ends the row (not kept in its Completion), and so does
    its max_tokens-th step.
    """

    def __init__(self, request, sample, max_tokens, special, tokenizer):
        self.request = request         # index of the prompt this row belongs to
        self.sample = sample           # index among that prompt's samples
        self.max_tokens = max_tokens
        self.special, self.tokenizer = special, tokenizer
        self.out = Completion([], [])
        self.forced = deque()          # tool output still to emit
        self.python_tokens = None      # the tool call being collected, when not None
        self.steps = 0

    @property
    def finished(self):
        return self.out.ended or self.steps >= self.max_tokens

    def feed(self, sampled_token, logprobs=(math.nan, math.nan)):
        """One step: (the token emitted, its mask). A queued forced token wins over the sampled one. logprobs:
        the sampled token's (under the model, under the sampled distribution), kept with a sampled token."""
        token, mask = (self.forced.popleft(), 0) if self.forced else (sampled_token, 1)
        self.steps += 1
        if token in self.special.terminal:
            self.out.ended = True
        else:
            self.out.tokens.append(token)
            self.out.masks.append(mask)
            model_lp, sampling_lp = logprobs if mask else (math.nan, math.nan)
            self.out.logprobs.append(model_lp)
            self.out.sampling_logprobs.append(sampling_lp)
            self._track_tool_call(token)
        return token, mask

    def _track_tool_call(self, token):
        sp = self.special
        if token == sp.python_start:
            self.python_tokens = []
        elif token == sp.python_end and self.python_tokens is not None:
            self._run_calculator()
        elif self.python_tokens is not None:
            self.python_tokens.append(token)

    def _run_calculator(self):
        sp = self.special
        self.out.tool_calls += 1
        text = format_result(use_calculator(self.tokenizer.decode(self.python_tokens)))
        self.python_tokens = None
        if text is not None:
            self.out.tool_successes += 1
            self.forced.extend([sp.output_start, *self.tokenizer.encode(text), sp.output_end])


# -----------------------------------------------------------------------------
# The batch of rows decoded together


@dataclass
class RolloutStats:
    """Work done by one generate call; used by tests (finished rows cost nothing) and the benchmark."""
    prefill_tokens: int = 0
    decode_forwards: int = 0
    row_steps: int = 0          # sum over decode forwards of the rows in the batch
    max_batch_rows: int = 0
    kv_positions_read: int = 0  # cached key/value positions the decode steps' attention read, per layer
    rows_allocated: int = 0     # rows of the KV cache the call allocated (set before allocating: an
                                # out-of-memory there still tells how many rows were tried)


@dataclass
class PrefilledPrompt:
    """A prompt that went through the model once, while its samples wait for slots."""
    request: int               # index of the prompt
    seed: int                  # sample r draws from the stream row_seed(seed, r)
    num_samples: int
    cache: KVCache             # one row: the prompt's keys and values
    logits: torch.Tensor       # (1, V) after the prompt: every sample's first token is drawn from these
    length: int                # the prompt's tokens
    admitted: int = 0          # samples 0..admitted-1 have had a slot

    @property
    def fully_admitted(self):
        return self.admitted == self.num_samples

    def next_samples(self, free_slots):
        """The samples that take the next `free_slots` slots (fewer if fewer are left)."""
        return range(self.admitted, min(self.num_samples, self.admitted + free_slots))


class DecodeBatch:
    """The rows decoded together, each in a slot of one KV cache of B rows.

    rows[i] is in slot i; the active rows are a dense prefix (the last row moves into a finished row's slot).
    Per slot: next_input (B,) the token it feeds next; seeds, steps (B,) its random stream (sample_next_token).
    With a SharedPromptKVCache (pool_slots given) each prompt's keys sit once in a pool slot, from its prefill
    until its last row finishes. A row is any object with `request`, `feed(sampled) -> (token, mask)` and
    `finished` (a Row; feed also takes the sampled token's log-probabilities); events are [(row, token, mask)] for
    the rows that emitted a token.

    The decode step (`run_step`) is static: it reads and writes only tensors allocated here or in the cache,
    takes the rows' positions from the host's own count (`offset`, `cached`) instead of the device, and runs a
    shape that `shapes` chooses: exactly the active rows and keys (eager, the default), or buckets that hold
    free rows too (their writes stay in their own slot, they never advance), so that a few shapes cover a
    whole rollout and `runner` can replay them from CUDA graphs. Per step the host reads the sampled tokens
    once and writes the next inputs (forced tool tokens included) in one copy.
    """

    def __init__(self, model, cache, temperature, top_k, stats, pool_slots=None, shapes=None, runner=None,
                 weights=None):
        self.model, self.cache, self.stats = model, cache, stats
        self.weights = weights or DecodeWeights(model)  # never refreshed: the model's own weights
        self.temperature, self.top_k = temperature, top_k
        B, self.device = cache.batch_size, model.get_device()
        self.rows = []
        self.next_input = torch.zeros(B, dtype=torch.long, device=self.device)
        self.seeds = torch.zeros(B, dtype=torch.long, device=self.device)
        self.steps = torch.zeros(B, dtype=torch.long, device=self.device)
        # the decode step's output per slot: (token, its log-probability under the model, under the sampled
        # distribution), as float32 (token ids are exact below 2**24) so that the host reads it in one copy
        self.sampled = torch.zeros(B, 3, dtype=torch.float32, device=self.device)
        cache.active.zero_()  # every slot free
        self.offset = [0] * B      # per slot: absolute position of the first key in its own storage (the prompt's
        self.cached = [0] * B      # length with a shared prompt, else 0), and how many keys it holds there
        self.rotary_len = getattr(model, "rotary_len", None)
        self.reuse_key = None      # set by the engine on a static batch it may reuse (Engine._new_batch)
        self.shapes = shapes or exact_shape
        # replays the step from graphs (GraphedStep), or None: run it. Made without a reference to this batch (no
        # bound method kept): a batch in a reference cycle would hold its KV cache until the next garbage collection
        self.graphs = runner() if runner else None
        self.free_pool = None if pool_slots is None else deque(range(pool_slots))
        self.pool_slot = {}        # request -> the pool slot holding its prompt
        self.unfinished = {}       # request -> its rows not finished yet, admitted or not

    @property
    def free_slots(self):
        return self.cache.batch_size - len(self.rows)

    def can_take_prompt(self):
        """False while every pool slot holds a prompt whose rows still run."""
        return self.free_pool is None or len(self.free_pool) > 0

    def prefill(self, request, prompt, seed, num_samples):
        """Run `prompt` (a list of ids) through the model, once for all its samples; with shared prompts its
        keys go to a free pool slot. Returns the PrefilledPrompt whose rows `admit` takes."""
        cache = KVCache.for_model(self.model, 1, len(prompt), self.cache.k.dtype)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # (1, T)
        logits = self._forward(ids, cache)[:, -1, :]  # (1, V)
        self.stats.prefill_tokens += len(prompt)
        if self.free_pool is not None:
            self.pool_slot[request] = self.free_pool.popleft()
            self.cache.store_prompt(self.pool_slot[request], cache)
        self.unfinished[request] = num_samples
        return PrefilledPrompt(request, seed, num_samples, cache, logits, len(prompt))

    def admit(self, prompt, rows):
        """`rows`, samples prompt.next_samples(free_slots) of `prompt`, take the first free slots, starting
        from the prompt's cache; each draws its first token from the prefill's logits. Returns their events."""
        lo, hi, first = len(self.rows), len(self.rows) + len(rows), prompt.admitted
        if self.free_pool is not None:
            self.cache.admit_rows(lo, hi, self.pool_slot[prompt.request], first, prompt.cache)
            self.offset[lo:hi], self.cached[lo:hi] = [prompt.length] * len(rows), [0] * len(rows)
        else:
            self.cache.fill_rows_from(lo, hi, prompt.cache)
            self.offset[lo:hi], self.cached[lo:hi] = [0] * len(rows), [prompt.length] * len(rows)
        self.seeds[lo:hi] = row_seeds(prompt.seed, range(first, first + len(rows)), self.device)
        self.steps[lo:hi] = 0
        self.rows.extend(rows)
        prompt.admitted += len(rows)
        self._draw(prompt.logits.expand(len(rows), -1), lo, hi)
        self.steps[lo:hi] += 1
        return self._feed(self.sampled[lo:hi].tolist(), lo)

    def decode_step(self):
        """One forward of every active row on its next input, then each samples and emits. Returns events."""
        n = len(self.rows)
        if n == 0:
            return []
        keys = max(self.cached[:n]) + 1  # this step's key included
        last_position = max(o + c for o, c in zip(self.offset[:n], self.cached[:n]))
        if self.rotary_len is not None and last_position >= self.rotary_len:
            raise ValueError(f"KV cache overflow: position {last_position} is past the rotary tables ({self.rotary_len})")
        if keys > self.cache.decode_capacity():
            raise ValueError(f"KV cache overflow: {keys} positions needed, the cache holds {self.cache.decode_capacity()}")
        rows, keys = self.shapes(n, keys, self.cache.batch_size, self.cache.decode_capacity())
        if self.graphs is None:
            self.run_step(rows, keys, last_position)
        else:
            self.graphs((rows, keys), lambda: self.run_step(rows, keys, last_position))
        for i in range(n):
            self.cached[i] += 1
        stats = self.stats
        stats.kv_positions_read += self.cache.keys_read(rows, keys)
        stats.decode_forwards += 1
        stats.row_steps += n
        stats.max_batch_rows = max(stats.max_batch_rows, n)
        return self._feed(self.sampled[:n].tolist(), 0)  # the step's one read from the device

    def run_step(self, rows, keys, last_position):
        """The static decode step over slots 0..rows-1, attending to keys 0..keys-1 of each: forward, sample
        into self.sampled, advance the streams of the rows in use. No host read, no shape that depends on data."""
        view = self.cache.decode_view(rows, keys, last_position)
        logits = self._forward(self.next_input[:rows, None], view)[:, -1, :]  # (rows, V)
        self._draw(logits, 0, rows)
        self.steps[:rows] += self.cache.active[:rows]

    def _forward(self, idx, cache):
        """The model's logits (B, T, V) for idx (B, T) over `cache`, with the decode weights in use."""
        with self.weights.in_use():
            return self.model(idx, kv_cache=cache)

    def _draw(self, logits, lo, hi):
        """Slots lo..hi-1 draw from logits (hi - lo, V), each with its own stream, into self.sampled."""
        tokens, model_lp, sampling_lp = sample_with_logprobs(logits, self.seeds[lo:hi], self.steps[lo:hi],
                                                             self.temperature, self.top_k)
        self.sampled[lo:hi] = torch.stack([tokens.float(), model_lp, sampling_lp], dim=1)

    def _feed(self, sampled, lo):
        """Rows lo.. (to the last) take their sampled (token, log-probability under the model, under the sampled
        distribution) and emit; what they emit is their next input (written in one copy), and the finished ones
        leave. Returns their events."""
        hi = len(self.rows)
        events = [(row, *row.feed(int(token), (model_lp, sampling_lp)))
                  for row, (token, model_lp, sampling_lp) in zip(self.rows[lo:hi], sampled)]
        self.next_input[lo:hi] = torch.tensor([token for _, token, _ in events], dtype=torch.long, device=self.device)
        self.retire([lo + j for j, (row, _, _) in enumerate(events) if row.finished])
        return events

    def retire(self, slots):
        """The rows in `slots` leave. The active rows stay a dense prefix: the last row moves into each hole,
        with its cache row (smear's prev_embedding included) and its next input, seed and step; the slot it
        leaves is released."""
        for i in sorted(slots, reverse=True):
            self._row_done(self.rows[i].request)
            last = len(self.rows) - 1
            if i != last:
                self.cache.copy_rows(torch.tensor([i], device=self.device), torch.tensor([last], device=self.device))
                for t in (self.next_input, self.seeds, self.steps):
                    t[i] = t[last]
                self.rows[i] = self.rows[last]
                self.offset[i], self.cached[i] = self.offset[last], self.cached[last]
            self.cache.release_row(last)
            self.rows.pop()

    def _row_done(self, request):
        self.unfinished[request] -= 1
        if self.unfinished[request] == 0:  # its prompt's keys are no longer read: the pool slot is free
            del self.unfinished[request]
            if self.free_pool is not None:
                self.free_pool.append(self.pool_slot.pop(request))


def exact_shape(rows, keys, max_rows, max_keys):
    """The eager step's shape: exactly the rows in use and the keys they need (no work on free slots)."""
    return rows, keys


# rows of a static step: powers of two and the halfway points between them, so that at most a third of a
# step's rows are free ones; keys in multiples of KEY_BUCKET. A 256-row, 256-token rollout uses a few dozen shapes.
ROW_BUCKETS = sorted({2 ** i for i in range(16)} | {3 * 2 ** i for i in range(15)})
KEY_BUCKET = 32
PROMPT_BUCKET = 64  # a static batch's prompt pool is rounded up to this, so that the next rollout can reuse it


def bucketed_shape(rows, keys, max_rows, max_keys):
    """The static step's shape: the smallest row bucket holding `rows` (at most the cache's rows) and `keys`
    rounded up to a multiple of KEY_BUCKET (at most the cache's keys)."""
    row_bucket = next(b for b in ROW_BUCKETS if b >= rows) if rows <= ROW_BUCKETS[-1] else rows
    return min(max_rows, row_bucket), min(max_keys, -(-keys // KEY_BUCKET) * KEY_BUCKET)


class SideStreamWarmUp:
    """Runs a step eagerly on a side stream, as PyTorch's CUDA-graph recipe warms up what it will capture (the
    libraries' lazy per-stream state, e.g. cuBLAS workspaces, is then made outside the capture); the current
    stream waits for it, so its results are there for whatever comes next. One stream for all the warm-ups of
    a batch's graphs (each stream keeps its own cached blocks)."""

    def __init__(self):
        self.stream = None

    def __call__(self, step):
        self.stream = self.stream or torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            step()
        torch.cuda.current_stream().wait_stream(self.stream)


def capture_cuda_graph(step, pool):
    """Record `step()` into a CUDA graph (capture records the kernels without running them) drawing on the memory
    pool `pool` (None: a new one). Returns (replay, the pool). Autocast's weight-cast cache is off while capturing:
    a cast cached during the capture would be freed after it, under the graph's feet (the engine's DecodeWeights
    leave it no weight to cast). Only this thread's CUDA calls are checked during the capture (the calculator's
    and loggers' threads never touch the GPU)."""
    graph = torch.cuda.CUDAGraph()
    autocast = dict(dtype=torch.get_autocast_dtype("cuda"), enabled=torch.is_autocast_enabled("cuda"))
    stream = torch.cuda.current_stream()
    try:
        with (torch.autocast("cuda", cache_enabled=False, **autocast),
              torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")):
            step()
    except RuntimeError as error:
        # torch.cuda.graph ends the capture before it restores the stream, so a capture that fails to end leaves
        # its own stream current: put ours back before anything else runs
        torch.cuda.set_stream(stream)
        # the allocator frees no cached block during a capture, so an out-of-memory there should come out as
        # itself; if it broke the capture, ending it fails instead (not seen on a GPU yet): raise the
        # out-of-memory, which the rollout backs off from with fewer rows
        if isinstance(error.__context__, torch.OutOfMemoryError):
            raise error.__context__ from error
        raise
    return graph.replay, graph.pool()


class GraphedStep:
    """A static decode step replayed from graphs, one per shape. A shape's first step runs eagerly through
    `warm_up` (it warms up kernels and workspaces; default: on a side stream), its second is captured by
    `capture` (capture_cuda_graph; the tests pass a CPU stand-in with the same semantics) and then replayed,
    like every later one. A replay runs what the capture recorded: the same tensors (the batch's buffers, cache
    and weights, updated in place) and every Python value as it was at the capture, so the step may take
    nothing from the host that changes between steps of a shape. All graphs share one memory pool: they never
    run at once, and none leaves a live tensor in it."""

    def __init__(self, capture=capture_cuda_graph, warm_up=None):
        self.capture, self.warm_up = capture, warm_up or SideStreamWarmUp()
        self.replays, self.seen, self.pool = {}, set(), None

    def __call__(self, shape, step):
        """Run step() (the decode step of `shape`), eagerly or from its graph."""
        replay = self.replays.get(shape)
        if replay is None and shape not in self.seen:
            self.seen.add(shape)
            self.warm_up(step)
            return
        if replay is None:
            replay, self.pool = self.capture(step, self.pool)
            self.replays[shape] = replay
        replay()


DECODE_MODES = ("auto", "eager", "static", "graph")
DECODE_DESCRIPTIONS = {
    "eager": "exact shapes, run eagerly",
    "static": "bucketed static shapes, run eagerly",
    "graph": "bucketed static shapes replayed from CUDA graphs",
}


def decode_mode(mode, device):
    """The decode mode that runs for `mode` on `device`: auto = graph on CUDA, eager elsewhere. eager = exact
    shapes (the rows in use, the keys they need); static = bucketed shapes run eagerly (what a graph captures;
    any device); graph = bucketed shapes replayed from CUDA graphs (CUDA only)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode mode must be one of {', '.join(DECODE_MODES)}, got {mode!r}")
    if mode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"decode mode graph needs a CUDA device (CUDA graphs), got {device.type}; use static or eager")
    return mode


def decode_plan(mode):
    """(shapes, runner, static cache) of a decode mode that runs (see decode_mode)."""
    if mode == "eager":
        return exact_shape, None, False
    return bucketed_shape, GraphedStep if mode == "graph" else None, True


def matmul_modules(model):
    """The modules whose fp32 weight autocast casts for a matmul: in nanochat's GPT every nn.Linear (lm_head and
    the gates included); embeddings are looked up and the scalars multiply in fp32."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32]


class DecodeWeights:
    """The model's matmul weights in the autocast dtype, which the engine's forwards use instead of the fp32
    parameters when rollouts run under bf16 or fp16 autocast.

    Autocast casts a matmul's fp32 weight to its dtype at every call, and uses a weight already in that dtype as
    it is: a copy made once gives bitwise the same outputs. Made once because inside a CUDA-graph capture the
    autocast cache is off (see GraphedStep), so a replayed step would cast every weight again: read fp32, write
    and read bf16, three times the bytes of the one bf16 read the step needs. The weights copied are those of
    matmul_modules; tests/test_decode_weights.py checks that autocast casts no other parameter.

    The copies are made at the first low-precision rollout and refreshed in place at the start of every one (the
    trainer changes the fp32 weights in between; in place, so graphs captured over them stay valid). They cost
    2 bytes per matmul weight (d20: 477M weights, 0.95 GB), kept between rollouts and not counted in the KV
    cache's memory_budget_gb: about what autocast's cache held during an eager bf16 rollout anyway. fp32
    rollouts make none. Training never sees them: they replace the parameters only inside `in_use`.
    """

    def __init__(self, model):
        self.model = model
        self.clear()

    @torch.no_grad()
    def refresh(self, dtype):
        """At the start of a rollout under autocast to `dtype` (None: no autocast): copies of the model's current
        fp32 matmul weights, in the storage of the last rollout's when the dtype is the same; none unless the
        dtype is bf16 or fp16."""
        if dtype != self.dtype:
            self.copies = []  # the old ones are freed before the new ones are allocated
            low = dtype in (torch.bfloat16, torch.float16)
            self.slots = [m._parameters for m in matmul_modules(self.model)] if low else []
            self.copies = [torch.empty_like(slot["weight"], dtype=dtype) for slot in self.slots]
            self.dtype = dtype
        for slot, copy in zip(self.slots, self.copies):
            copy.copy_(slot["weight"])

    def clear(self):
        """No copies (the next refresh makes new ones)."""
        self.dtype, self.slots, self.copies = None, [], []  # slots: the Linear modules' parameter dicts

    @contextmanager
    def in_use(self):
        """The model's matmul weights are the copies inside this block. Written into the modules' parameter dicts
        directly: nn.Module.__setattr__ takes only Parameters, and over d20's 121 weights torch.func.functional_call
        costs ~1 ms per forward, this 0.03 ms."""
        originals = [slot["weight"] for slot in self.slots]
        for slot, copy in zip(self.slots, self.copies):
            slot["weight"] = copy
        try:
            yield
        finally:
            for slot, weight in zip(self.slots, originals):
                slot["weight"] = weight


# -----------------------------------------------------------------------------
# The engine


class Engine:
    """KV-cached sampling with the calculator tool.

    `generate`/`generate_batch` are nanochat's one-prompt API. `generate_many` is the batched rollout API:
    many prompts, `num_samples` rows each, decoded together in one KV-cached batch of at most `max_rows`
    rows; each prompt is prefilled once; finished rows leave the batch at once and waiting rows take their
    place. With share_prompts (the default) a prompt's keys and values are stored once for all its rows
    (SharedPromptKVCache: more rows fit, fewer bytes read per token); without, each row holds a copy, as
    nanochat does. Row r of a prompt with seed s samples with its own stream row_seed(s, r), so its output
    does not depend on the batch it shares. Under bf16/fp16 autocast the forwards use the matmul weights cast once
    per rollout (DecodeWeights).
    """

    def __init__(self, model, tokenizer, max_rows=None, memory_budget_gb=4.0, share_prompts=True, decode="auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.special = SpecialIds(tokenizer)
        self.max_rows = max_rows
        self.memory_budget_gb = memory_budget_gb
        self.share_prompts = share_prompts
        self.decode = decode_mode(decode, model.get_device())  # an unusable mode fails here, not at a rollout
        self.kept_batch = None  # a static batch between rollouts (see _new_batch); release() drops it
        self.keeps_between_rollouts = True  # the static batch and the decode weights; release() may turn it off
        self.weights = DecodeWeights(model)
        self.last_stats = RolloutStats()

    def release(self, keep_from_now_on=True):
        """Drop what is kept between rollouts: the static batch (its KV cache and CUDA graphs, captured over the
        decode weights) and the decode weights, e.g. to give their memory to training after an out-of-memory.
        With keep_from_now_on=False later rollouts free theirs when they end. True if anything was held."""
        held = self.kept_batch is not None or bool(self.weights.copies)
        self.kept_batch = None
        self.weights.clear()
        self.keeps_between_rollouts = keep_from_now_on
        return held

    # -- nanochat's API ------------------------------------------------------------
    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """Yield (token_column, token_masks) per step, one entry per row. A row that has ended keeps
        appearing as <|assistant_end|> with mask 0 until all rows end (nanochat keeps sampling them)."""
        pad = self.special.assistant_end
        for events in self._rollout([list(tokens)], num_samples, max_tokens, temperature, top_k, [seed]):
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

    # -- batched rollouts ------------------------------------------------------------
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

    def rows_for_budget(self, prompt_len, max_tokens, dtype, num_samples=1):
        """How many rows' KV cache fit in the memory budget: prompt + completion per row, or with shared
        prompts a completion per row plus the prompt pool (about 2 prompts per num_samples rows, see
        prompt_slots). The budget is the KV cache's: bf16 decode weights (DecodeWeights) come on top."""
        per_token = SharedPromptKVCache.bytes_per_token(self.model, dtype)
        budget_tokens = self.memory_budget_gb * (1 << 30) / per_token
        if not self.share_prompts:
            return max(1, int(budget_tokens // (prompt_len + max_tokens)))
        return max(1, int((budget_tokens - prompt_len) // (max_tokens + 2 * prompt_len / num_samples)))

    @staticmethod
    def prompt_slots(rows, num_samples, num_prompts):
        """Prompts held at once with shared prompts: the ones the rows are on, plus room for prompts whose
        last rows are still running while the next ones start."""
        return max(1, min(num_prompts, 2 * math.ceil(rows / num_samples) + 1))

    def _autocast_dtype(self):
        """The dtype autocast runs matmuls in on the model's device; None outside autocast."""
        device = self.model.get_device().type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    def _new_batch(self, num_prompts, longest, num_samples, max_tokens, temperature, top_k, max_rows):
        """An empty DecodeBatch: max_rows rows (else the engine's, else what the memory budget holds), at most
        one per sample of every prompt, with a cache for prompts of up to `longest` tokens. A static batch
        (static and graph modes) is kept after a rollout that ran to its end and taken again by the next one
        of the same shape, so its cache and its captured CUDA graphs are made once per run, not once per
        rollout (its prompt pool rounded up to PROMPT_BUCKET positions, so prompts of other lengths fit)."""
        model = self.model
        dtype = self._autocast_dtype() or next(model.parameters()).dtype
        cap = max_rows or self.max_rows or self.rows_for_budget(longest, max_tokens, dtype, num_samples)
        B = max(1, min(cap, num_prompts * num_samples))
        pool_slots = self.prompt_slots(B, num_samples, num_prompts) if self.share_prompts else None
        shapes, runner, static = decode_plan(self.decode)
        prompt_cap = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET if static else longest
        key = (B, pool_slots, prompt_cap, max_tokens, num_samples, dtype, temperature, top_k, self.share_prompts)
        self.last_stats = RolloutStats(rows_allocated=B)
        kept, self.kept_batch = self.kept_batch, None
        if kept is not None and kept.reuse_key == key:
            kept.stats = self.last_stats
            return kept
        del kept  # its memory is free before the new cache is allocated
        if self.share_prompts:
            cache = SharedPromptKVCache.for_model(model, B, pool_slots, prompt_cap, max_tokens, num_samples, dtype, static)
        else:
            cache = KVCache.for_model(model, B, prompt_cap + max_tokens, dtype)
        batch = DecodeBatch(model, cache, temperature, top_k, self.last_stats, pool_slots, shapes, runner, self.weights)
        batch.reuse_key = key if static else None
        return batch

    @torch.no_grad()
    def _rollout(self, prompts, num_samples, max_tokens, temperature, top_k, seeds, max_rows=None):
        """The decode loop every API adapts. Yields, per step, the events [(row, token, mask)] of the rows
        that emitted a token; a row whose `finished` is set has just left the batch (it does so once)."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (render_for_completion starts with <|bos|>)")
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = max(1, self.model.config.sequence_len - longest)
        self.weights.refresh(self._autocast_dtype())  # the trainer has changed the weights since the last rollout
        batch = self._new_batch(len(prompts), longest, num_samples, max_tokens, temperature, top_k, max_rows)
        waiting, pending = deque(range(len(prompts))), None  # prompts not prefilled yet; the one being admitted
        while batch.rows or waiting or pending is not None:
            events = batch.decode_step()
            while batch.free_slots > 0 and (pending is not None or waiting):
                if pending is None:
                    if not batch.can_take_prompt():
                        break  # every pool slot holds a prompt whose rows still run: wait for one to finish
                    request = waiting.popleft()
                    pending = batch.prefill(request, prompts[request], seeds[request], num_samples)
                rows = [Row(pending.request, s, max_tokens, self.special, self.tokenizer)
                        for s in pending.next_samples(batch.free_slots)]
                events += batch.admit(pending, rows)
                pending = None if pending.fully_admitted else pending
            if events:
                yield events
        if not self.keeps_between_rollouts:
            self.weights.clear()
        elif batch.reuse_key is not None:  # every row retired and every pool slot freed: ready for the next rollout
            self.kept_batch = batch

