"""
The KV cache every row of which holds its own copy of its keys and values (nanochat's), and the interface a
rollout's cache offers the decode batch (`RolloutCache`), which nanochat/engine/shared_prompt_cache.py implements too.

A cache is data: tensors, and the steps (nanochat/model/attention.py's CacheStep) that read and write them during
one forward. It never calls the model; the caller builds a step, runs the model on it and advances the cache.
"""

from typing import NamedTuple, Optional, Protocol

import torch
import torch.nn as nn

from nanochat.model.attention import CacheStep, Visibility, attend, run_cached, sequence_mask, window_mask


def write_rows(store, layer, rows, positions, values, heads_first=False):
    """cache[rows, positions] = values, in place, where cache is store[layer] ((B, T_max, Hkv, D)), or with
    heads_first store[layer] transposed from (B, Hkv, T_max, D): how a cache step writes this step's keys and
    values. rows, positions: broadcastable index tensors; values: their shape + (Hkv, D). Traced by torch.compile,
    through the operator store_rows (see there); eagerly, the index_put itself, without the operator's dispatch
    (called for every layer at every step, that dispatch was a noticeable share of a small model's eager rollout on
    a CPU; docs/performance.md)."""
    if torch.compiler.is_compiling():
        store_rows(store, layer, rows, positions, values, heads_first)
    else:
        _index_put_rows(store, layer, rows, positions, values, heads_first=heads_first)


def _index_put_rows(store, layer, rows, positions, values, heads_first=False):
    # heads_first has its default here too: the dispatcher leaves out an argument equal to the schema's default
    cache = store[layer].transpose(1, 2) if heads_first else store[layer]
    cache.index_put_((rows, positions), values)


# write_rows as an operator of its own, for torch.compile: it declares what it mutates (the schema's "Tensor(a!)").
# Compiled (nanochat/compiling/functions.py), a plain index_put into a view of a graph input is functionalized into a write
# of the whole cache, copied per layer and step (the compiled decode step was then several times slower than the eager
# one; docs/performance.md), while an operator that mutates its argument is written in place by Inductor (vLLM writes
# its KV cache through such an operator for the same reason). It takes the whole storage and the layer, not the
# layer's view: with dynamic shapes (the compiled static step serves every bucket from one graph) Inductor (torch
# 2.13) computed wrong results when a custom operator mutated a view of a graph input (greedy decoding took another
# token within a few steps; tests/compiling/test_compile.py holds a minimal case). Defined through torch.library.Library, not
# the custom_op decorator, whose Python wrapper (argument defaults, autograd redispatch) adds its cost to every call,
# two per layer and step; vLLM registers its own operators directly for the same reason.
_OPERATORS = torch.library.Library("nanochat", "FRAGMENT")  # a fragment: another module may define in the namespace
_OPERATORS.define("store_rows(Tensor(a!) store, int layer, Tensor rows, Tensor positions, Tensor values, "
                  "bool heads_first=False) -> ()")
_OPERATORS.impl("store_rows", _index_put_rows, "CompositeExplicitAutograd")


@torch.library.register_fake("nanochat::store_rows")
def _store_rows_fake(store, layer, rows, positions, values, heads_first=False):
    return None


store_rows = torch.ops.nanochat.store_rows.default


class CacheGeometry(NamedTuple):
    """What a KV cache for a model needs to know."""
    n_kv_head: int
    head_dim: int
    n_layer: int
    device: torch.device
    dtype: torch.dtype           # the model's compute dtype: its matmul weights' (a nanochat CUDA checkpoint may
                                 # store the embeddings in bf16 for an fp32 model)
    smear_dim: Optional[int]     # embed_dim of the per-row smear state, None for generations without smear
    smear_dtype: Optional[torch.dtype]  # the token embeddings' dtype, which the smear state holds

    def bytes_per_token(self, dtype):
        """Bytes of keys and values one cached position takes over all layers, stored in `dtype`."""
        return 2 * self.n_layer * self.n_kv_head * self.head_dim * torch.tensor([], dtype=dtype).element_size()


def cache_geometry(model):
    """The CacheGeometry of `model`. A model without a `generation` (a test double) carries no smear state."""
    cfg = model.config
    smear = getattr(getattr(model, "generation", None), "smear", False)
    linears = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    compute_dtype = (linears or list(model.parameters()))[0].dtype
    return CacheGeometry(cfg.n_kv_head, cfg.n_embd // cfg.n_head, cfg.n_layer, model.get_device(), compute_dtype,
                         smear_dim=cfg.n_embd if smear else None,
                         smear_dtype=model.transformer.wte.weight.dtype if smear else None)


class RolloutCache(Protocol):
    """What the decode batch (nanochat/engine/decode_batch.py) asks of its cache: B rows, each a slot of one sample in
    flight, written by the model through decode steps and moved or freed by the batch. Positions: a row's
    keys 0.. in its own storage stand at absolute positions offset.. (offset: what admit_rows returned, the
    prompt's length when the cache keeps the prompt elsewhere, else 0)."""
    active: torch.Tensor  # (B,) 1 for a row in use, 0 for a free one (which no step moves)

    @property
    def batch_size(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def key_capacity(self) -> int:
        """Keys of its own storage a row can hold (what a decode step may read)."""

    def holds_prompts(self) -> bool:
        """Whether prompts are stored once in the cache (store_prompt) rather than copied into each row."""

    def admit_rows(self, start: int, stop: int, prompt_cache: "KVCache", pool_slot: Optional[int],
                   first_sample: int) -> int:
        """Rows [start, stop) start from a prefilled prompt (samples first_sample.. of it; pool_slot: where
        store_prompt stored it, None if the cache holds no prompts). Returns the prompt positions the rows hold in
        their own storage."""

    def decode_step(self, rows: int, keys: int) -> CacheStep:
        """A single-token forward of rows 0..rows-1 reading keys 0..keys-1 of each one's own storage, which
        must cover every row in use, this step's key included."""

    def keys_read(self, rows: int, keys: int) -> int:
        """Key/value positions per layer a decode_step(rows, keys) reads."""

    def copy_rows(self, dst: int, src: int) -> None:
        """Row dst becomes a copy of row src."""

    def release_row(self, row: int) -> None:
        """Row `row` is free: no step moves it and nothing reads its entries."""


class KVCache:
    """Keys and values of every layer for B rows, each row at its own position.

    k, v: (n_layer, B, T_max, n_kv_head, head_dim)
    pos:  (B,) int64, how many tokens of each row are cached (rows may differ).
    active: (B,) int64, 1 for a row in use; a forward advances only those (a static-shape decode step runs
          every row of its bucket, and a free row must stay where it was: at 0).
    prev_embedding: (B, 1, embed_dim) or None: the normed embedding of each row's last cached token, for
          generations that smear it into the next position (zeros for an empty row: adds nothing).

    A step of T tokens (`step`, `decode_step`) puts row b's new tokens at positions pos[b] .. pos[b]+T-1; each
    layer writes its k, v there and attends to the row's own cached positions (causal, and windowed for
    short-window layers). Entries past a row's position are never read unmasked, and the storage starts zeroed
    so masked entries are finite (0 * garbage must not make NaN).
    """

    def __init__(self, batch_size, num_heads, seq_len, head_dim, num_layers, device="cpu", dtype=torch.float32,
                 embed_dim=None, embed_dtype=torch.float32, spare_positions=0):
        # spare_positions: allocated past seq_len and never read, as a static batch's cache has one (see
        # SharedPromptKVCache: a compiled step whose keys spanned the whole storage compiled a graph of its own)
        self.spare_positions = spare_positions
        shape = (num_layers, batch_size, seq_len + spare_positions, num_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.active = torch.ones(batch_size, dtype=torch.long, device=device)
        self.prev_embedding = (None if embed_dim is None else
                               torch.zeros(batch_size, 1, embed_dim, device=device, dtype=embed_dtype))

    @classmethod
    def for_model(cls, model, batch_size, seq_len, dtype=None, spare_positions=0):
        """An empty cache shaped for `model`, with the per-row state its generation carries between steps."""
        g = cache_geometry(model)
        return cls(batch_size, g.n_kv_head, seq_len, g.head_dim, g.n_layer, device=g.device, dtype=dtype or g.dtype,
                   embed_dim=g.smear_dim, embed_dtype=g.smear_dtype, spare_positions=spare_positions)

    @property
    def batch_size(self):
        return self.k.size(1)

    @property
    def max_seq_len(self):
        return self.k.size(2)

    @property
    def dtype(self):
        return self.k.dtype

    @property
    def key_capacity(self):
        return self.max_seq_len - self.spare_positions

    def reset(self):
        self.pos.zero_()
        if self.prev_embedding is not None:
            self.prev_embedding.zero_()

    def get_pos(self):
        """The largest row position (equal to every row's position when rows move in lockstep)."""
        return int(self.pos.max())

    def step(self, T, max_positions=None):
        """A forward of T tokens per row after what each holds (one host read, for the keys it spans).
        max_positions: positions the model's rotary tables cover, if limited."""
        keys = int(self.pos.max()) + T
        if keys > self.key_capacity or (max_positions is not None and keys > max_positions):
            raise ValueError(f"KV cache overflow: {keys} positions needed, the cache holds {self.key_capacity} "
                             f"and the rotary tables {max_positions}")
        return KVCacheStep(self, T, keys)

    def decode_step(self, rows, keys):
        return KVCacheStep(self.rows(0, rows), 1, keys)

    def keys_read(self, rows, keys):
        return rows * keys

    def holds_prompts(self):
        return False

    def admit_rows(self, start, stop, prompt_cache, pool_slot, first_sample):
        """Rows [start, stop) become copies of the single row of `prompt_cache` (pool_slot and first_sample do not
        matter: every row holds its prompt)."""
        length = prompt_cache.max_seq_len
        self.k[:, start:stop, :length] = prompt_cache.k[:, 0:1]
        self.v[:, start:stop, :length] = prompt_cache.v[:, 0:1]
        self.pos[start:stop] = prompt_cache.pos[0]
        self.active[start:stop] = 1
        if self.prev_embedding is not None:
            self.prev_embedding[start:stop] = prompt_cache.prev_embedding[0:1]
        return length

    def rows(self, start, stop):
        """A cache over rows [start, stop) that shares storage with this one (writes land here)."""
        view = KVCache.__new__(KVCache)
        view.spare_positions = self.spare_positions
        view.k, view.v, view.pos = self.k[:, start:stop], self.v[:, start:stop], self.pos[start:stop]
        view.active = self.active[start:stop]
        view.prev_embedding = None if self.prev_embedding is None else self.prev_embedding[start:stop]
        return view

    def row_prefix(self, row, length):
        """A one-row cache over the first `length` positions of row `row`, sharing this one's storage: one prompt of
        a batched prefill (nanochat/engine/decode_batch.py), as a prefill of that prompt alone would have left it."""
        view = KVCache.__new__(KVCache)
        view.spare_positions = 0
        view.k, view.v = self.k[:, row:row + 1, :length], self.v[:, row:row + 1, :length]
        view.pos, view.active = self.pos[row:row + 1], self.active[row:row + 1]
        view.prev_embedding = None if self.prev_embedding is None else self.prev_embedding[row:row + 1]
        return view

    def copy_rows(self, dst, src):
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


class KVCacheStep:
    """A forward of T tokens per row over a KVCache (the CacheStep of nanochat/model/attention.py): each layer stores
    its new keys/values at the rows' positions and attends to the rows' cached keys 0..keys-1 (the masks hide
    what a row does not have). A chunk of several tokens smears inside itself only."""

    def __init__(self, cache, T, keys):
        self.cache, self.T, self.keys = cache, T, keys
        device = cache.pos.device
        self.positions = cache.pos[:, None] + torch.arange(T, device=device)  # (B, T)
        self.rows = torch.arange(cache.batch_size, device=device)[:, None]  # (B, 1)
        if keys == T:  # every row starts at 0 (a prefill): the uncached masks apply, causal kernels included
            self.mask = Visibility(lambda window: sequence_mask(T, window, device))
        else:
            self.mask = Visibility(lambda window: window_mask(self.positions, keys, window)[:, None])  # (B, 1, T, keys)
        has_smear = cache.prev_embedding is not None
        self.smear_previous = cache.prev_embedding.clone() if has_smear and T == 1 else None

    def attend(self, layer_idx, q, k, v, window):
        write_rows(self.cache.k, layer_idx, self.rows, self.positions, k.to(self.cache.k.dtype))
        write_rows(self.cache.v, layer_idx, self.rows, self.positions, v.to(self.cache.v.dtype))
        k_store, v_store = self.cache.k[layer_idx], self.cache.v[layer_idx]  # (B, T_max, Hkv, D)
        # attend in q's dtype: no copy when the cache has it
        return attend(q, k_store[:, :self.keys].to(q.dtype), v_store[:, :self.keys].to(q.dtype), self.mask(window))

    def keep_smear_state(self, embedding):
        self.cache.prev_embedding.copy_(embedding)

    def advance(self):
        self.cache.pos.add_(self.cache.active, alpha=self.T)


def forward_cached(model, idx, cache):
    """Logits (B, T, V) of idx (B, T) after what each row of `cache` (a KVCache or a view of its rows) holds;
    then the cache holds them too. The host reads the rows' largest position once."""
    return run_cached(model, idx, cache.step(idx.size(1), getattr(model, "rotary_len", None)))
