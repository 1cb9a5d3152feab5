"""
The KV cache of batched decoding when rows share prompts (a RolloutCache, see nanochat/engine/kv_cache.py): each
prompt's keys and values are stored once, in a prompt slot of a pool, and each row stores only its completion.
"""

import math

import torch

from nanochat.engine.kv_cache import cache_geometry, write_rows
from nanochat.engine.variants.flex_prompt_attention import run_flex_prompt_attention
from nanochat.model.attention import Visibility, fp32_scores


class SharedPromptKVCache:
    """pool_k, pool_v: (n_layer, slots, n_kv_head, prompt_cap, head_dim); pool_len: (slots,) prompt lengths
    k, v:           (n_layer, B, n_kv_head, capacity, head_dim);     pos: (B,) completion tokens cached
                    capacity grows on demand (doubling, up to suffix_cap), so rows that end early never pay
                    for max_tokens positions
    prompt_slot, sample: (B,) the row's prompt slot and its index among that prompt's rows; a free row has
                    sample rows_per_slot: in a static cache, a spare column of the prompt attention's layout
                    that no row in use shares (a dynamic one never runs free rows)
    active:         (B,) 1 for a row in use, as in KVCache
    prev_embedding: (B, 1, embed_dim) or None, as in KVCache

    Only single-token decode steps run on it (prompts are prefilled into a one-row KVCache, then stored
    with `store_prompt`). A row's query at absolute position p = prompt length + pos attends to its prompt's
    keys and to its own completion; both score sets go through one softmax, so the result is attention over the
    concatenation, exactly. The prompt's scores are computed per slot for all its rows at once: the prompt's
    keys and values are read once per step and layer, not once per row.
    """

    INITIAL_SUFFIX_CAPACITY = 64

    def __init__(self, batch_size, slots, prompt_cap, suffix_cap, num_heads, head_dim, num_layers, device="cpu",
                 dtype=torch.float32, rows_per_slot=1, embed_dim=None, embed_dtype=torch.float32, static=False,
                 step_class=None):
        self.pool_k = torch.zeros(num_layers, slots, num_heads, prompt_cap, head_dim, device=device, dtype=dtype)
        self.pool_v = torch.zeros_like(self.pool_k)
        self.pool_len, self.suffix_cap = torch.zeros(slots, dtype=torch.long, device=device), suffix_cap
        # static: for decode steps over a fixed number of rows (free ones included) that may be captured: every
        # position is allocated now, so the storage never moves, and free rows get a spare sample column. And one
        # position more, never read: a step's keys then never span the whole storage, and the compiled step's
        # slices of it are never the whole of it (Dynamo compiled the steps whose keys did as graphs of their own,
        # twice as many graphs for a static batch's shapes; docs/performance.md)
        self.static = static
        capacity = suffix_cap + 1 if static else min(suffix_cap, self.INITIAL_SUFFIX_CAPACITY)
        self.k = torch.zeros(num_layers, batch_size, num_heads, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.prompt_slot = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.rows_per_slot = rows_per_slot  # the largest sample index + 1 (num_samples)
        self.sample = torch.full((batch_size,), rows_per_slot, dtype=torch.long, device=device)  # all rows free
        self.active = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.prev_embedding = (None if embed_dim is None else
                               torch.zeros(batch_size, 1, embed_dim, device=device, dtype=embed_dtype))
        # what each decode step over it is: SharedPromptStep, or another of nanochat/engine/decode_steps.py's table
        self.step_class = step_class or SharedPromptStep

    @classmethod
    def for_model(cls, model, batch_size, slots, prompt_cap, suffix_cap, rows_per_slot, dtype=None, **options):
        """options: the constructor's static and step_class."""
        g = cache_geometry(model)
        return cls(batch_size, slots, prompt_cap, suffix_cap, g.n_kv_head, head_dim=g.head_dim, num_layers=g.n_layer,
                   device=g.device, dtype=dtype or g.dtype, rows_per_slot=rows_per_slot, embed_dim=g.smear_dim,
                   embed_dtype=g.smear_dtype, **options)

    batch_size = property(lambda self: self.k.size(1))
    dtype = property(lambda self: self.k.dtype)
    # the prompt attention's sample columns: + the spare column of free rows in a static cache (1 if ..., not + bool:
    # a symbolic size plus a bool breaks torch 2.11's shape tracing)
    grid_columns = property(lambda self: self.rows_per_slot + (1 if self.static else 0))

    key_capacity = property(lambda self: self.suffix_cap, doc="Completion keys a row can hold: all it may grow to.")
    prompt_slots = property(lambda self: self.pool_k.size(1))

    def holds_prompts(self):
        return True

    def ensure_suffix_capacity(self, needed):
        """Make room for `needed` completion positions per row (grows by doubling; entries past a row's position
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

    def store_prompt(self, slot, prompt_cache):
        """Prompt slot `slot` holds from now on the one row of `prompt_cache` (a prefill as long as its prompt)."""
        length = prompt_cache.max_seq_len  # not pos[0]: that would be a read from the device for each prompt
        if length > self.pool_k.size(3):
            raise ValueError(f"prompt of {length} tokens does not fit the pool's {self.pool_k.size(3)} positions")
        self.pool_k[:, slot, :, :length] = prompt_cache.k[:, 0, :length].transpose(1, 2)
        self.pool_v[:, slot, :, :length] = prompt_cache.v[:, 0, :length].transpose(1, 2)
        self.pool_len[slot] = length

    def admit_rows(self, start, stop, prompt_cache, pool_slot, first_sample):
        """Rows [start, stop) begin as samples first_sample.. of the prompt in prompt slot `pool_slot` (stored
        from prompt_cache); they hold none of its positions themselves."""
        self.pos[start:stop] = 0
        self.prompt_slot[start:stop] = pool_slot
        self.sample[start:stop] = torch.arange(first_sample, first_sample + stop - start, device=self.pos.device)
        self.active[start:stop] = 1
        if self.prev_embedding is not None:
            self.prev_embedding[start:stop] = prompt_cache.prev_embedding[0:1]
        return 0

    def copy_rows(self, dst, src):
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        for t in (self.pos, self.prompt_slot, self.sample, self.active):
            t[dst] = t[src]
        if self.prev_embedding is not None:
            self.prev_embedding[dst] = self.prev_embedding[src]

    def release_row(self, row):
        """Row `row` is free: at position 0, in the spare sample column, and no forward moves it."""
        self.active[row] = 0
        self.pos[row] = 0
        self.prompt_slot[row] = 0
        self.sample[row] = self.rows_per_slot

    # what a prefix view shares with its cache as it is, and what it takes the first rows of
    SHARED_FIELDS = ("pool_k", "pool_v", "pool_len", "static", "rows_per_slot", "step_class")
    ROW_FIELDS = ("pos", "prompt_slot", "sample", "active")

    def prefix(self, rows):
        """A cache over rows 0..rows-1 sharing this one's storage and pool (the rows in use are a dense prefix).
        Field by field, not by copying __dict__: Dynamo (torch 2.11, the first CUDA run's) cannot trace
        `__dict__.update` inside the compiled decode step."""
        view = SharedPromptKVCache.__new__(SharedPromptKVCache)
        for name in self.SHARED_FIELDS:
            setattr(view, name, getattr(self, name))
        for name in self.ROW_FIELDS:
            setattr(view, name, getattr(self, name)[:rows])
        view.k, view.v = self.k[:, :rows], self.v[:, :rows]
        view.suffix_cap = self.k.size(3)  # a view cannot grow: the base cache grows before views are taken
        view.prev_embedding = None if self.prev_embedding is None else self.prev_embedding[:rows]
        return view

    def next_positions(self):
        """(B,) the absolute position each row's next token takes: its prompt's length plus its completion's."""
        return self.pool_len[self.prompt_slot] + self.pos

    def decode_step(self, rows, keys):
        """Grows the completion storage first when needed (a view cannot grow)."""
        self.ensure_suffix_capacity(keys)
        return self.step_class(self.prefix(rows), keys, whole=self)

    def keys_read(self, rows, keys):
        """Each prompt slot's prompt once, and `keys` per row."""
        return self.pool_k.size(1) * self.pool_k.size(3) + rows * keys


class SharedPromptStep:
    """One single-token decode step over a SharedPromptKVCache (see there; the CacheStep of
    nanochat/model/attention.py). Each row's query attends to its prompt's keys and to its completion's first
    `suffix_keys` keys (this step's included).

    What depends only on the rows, not on the layer, is made once per step: how far back from its row's query each
    key is (`far`), a window's additive mask (0 or -inf, at the first layer of that window) and the prompt
    attention's layouts (at the first layer)."""

    NEVER = torch.iinfo(torch.int64).max  # how far back a key the row never sees is: beyond every window

    def __init__(self, cache, suffix_keys, whole=None):  # whole: the cache viewed, unused here (decode_steps.py's form)
        self.cache, self.S = cache, suffix_keys
        device = cache.pos.device
        B = cache.batch_size
        self.row_index = torch.arange(B, device=device)
        next_positions = cache.next_positions()  # (B,)
        self.positions = next_positions[:, None]  # (B, 1)
        self._prepare_visibility(next_positions)
        has_smear = cache.prev_embedding is not None
        self.smear_previous = cache.prev_embedding.clone() if has_smear else None

    def _prepare_visibility(self, next_positions):
        """What every layer's attention reads of which key each row sees: `far` and the windows' masks, the prompt
        attention's layouts (made at the first layer)."""
        cache, suffix_keys, device = self.cache, self.S, next_positions.device
        lengths = cache.pool_len[cache.prompt_slot]  # (B,) each row's prompt's
        # (B, 1, 1, Lp + S): the prompt's keys, then the completion's; NEVER for a prompt slot past the prompt's end and
        # a completion position past this step's
        prompt_keys = torch.arange(cache.pool_k.size(3), device=device)  # (Lp,)
        prompt_far = (next_positions[:, None] - prompt_keys).masked_fill(prompt_keys >= lengths[:, None], self.NEVER)
        suffix_far = cache.pos[:, None] - torch.arange(suffix_keys, device=device)  # (B, S)
        suffix_far = suffix_far.masked_fill(suffix_far < 0, self.NEVER)
        far = torch.cat([prompt_far, suffix_far], dim=1)[:, None, None]
        visible = far.new_zeros(far.shape, dtype=torch.float32)
        # per window: 0 where the key is visible, -inf where not, added to the fp32 scores
        self.mask = Visibility(lambda window: visible.masked_fill(far > window, float("-inf")))
        self.layouts = {}  # dtype -> the prompt attention's (queries, probabilities) by slot, see _layouts

    def _layouts(self, q, Lp):
        """The prompt attention's inputs laid out by prompt slot: queries (slots, Hkv, G, rep, D) and probabilities
        (slots, Hkv, G, rep, Lp), where row b is at [prompt_slot[b], :, sample[b]]. Zeros, made at the first layer:
        every layer writes the same places, so the others stay zero."""
        if q.dtype not in self.layouts:
            c = self.cache
            slots, G = c.pool_k.size(1), c.grid_columns
            Hkv, rep, D = q.shape[1:]
            self.layouts[q.dtype] = q.new_zeros(slots, Hkv, G, rep, D), q.new_zeros(slots, Hkv, G, rep, Lp)
        return self.layouts[q.dtype]

    def attend(self, layer_idx, q, k, v, window):
        c = self.cache
        B, _, H, D = q.shape  # (B, 1, H, D)
        Hkv = k.size(2)
        rep = H // Hkv
        self._store_new_keys(layer_idx, k, v)
        q = q[:, 0].reshape(B, Hkv, rep, D)
        pool_k, pool_v = c.pool_k[layer_idx].to(q.dtype), c.pool_v[layer_idx].to(q.dtype)  # (slots, Hkv, Lp, D)
        slots, Lp = pool_k.size(0), pool_k.size(2)
        # prompt part: the queries of each slot's rows laid out as (slot, kv head, sample, rep) -> one matmul per
        # slot and kv head reads that prompt's keys once
        grid, prompt_probs = self._layouts(q, Lp)
        G = grid.size(2)
        grid[c.prompt_slot, :, c.sample] = q
        # scores in fp32, as the trainer's attention keeps them
        prompt_scores = fp32_scores(grid.view(slots, Hkv, G * rep, D), pool_k.transpose(-1, -2)).view(slots, Hkv, G, rep, Lp)
        # own part: the row's completion so far, this step's token included
        suffix_k = c.k[layer_idx][:, :, :self.S].to(q.dtype)  # (B, Hkv, S, D)
        suffix_v = c.v[layer_idx][:, :, :self.S].to(q.dtype)
        suffix_scores = fp32_scores(q, suffix_k.transpose(-1, -2))  # (B, Hkv, rep, S)
        scores = torch.cat([prompt_scores[c.prompt_slot, :, c.sample], suffix_scores], dim=-1)  # (B, Hkv, rep, Lp + S)
        # mask + scores / sqrt(D) in one kernel: the product rounded once, then + 0 or -inf (exact)
        scores = torch.add(self.mask(window), scores, alpha=1.0 / math.sqrt(D))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # one softmax over prompt and completion keys
        prompt_probs[c.prompt_slot, :, c.sample] = probs[..., :Lp]
        prompt_out = torch.bmm(prompt_probs.view(slots * Hkv, G * rep, Lp), pool_v.reshape(slots * Hkv, Lp, D))
        suffix_out = torch.bmm(probs[..., Lp:].reshape(B * Hkv, rep, self.S), suffix_v.reshape(B * Hkv, self.S, D))
        y = prompt_out.view(slots, Hkv, G, rep, D)[c.prompt_slot, :, c.sample] + suffix_out.view(B, Hkv, rep, D)
        return y.reshape(B, H, 1, D)

    def _store_new_keys(self, layer_idx, k, v):
        """This step's key and value (B, 1, Hkv, D) go into each row's completion, at its position: the (B, Hkv,
        capacity, D) storage written as (B, capacity, Hkv, D), where a row's position is its second index."""
        c = self.cache
        write_rows(c.k, layer_idx, self.row_index, c.pos, k[:, 0].to(c.k.dtype), heads_first=True)
        write_rows(c.v, layer_idx, self.row_index, c.pos, v[:, 0].to(c.v.dtype), heads_first=True)

    def keep_smear_state(self, embedding):
        self.cache.prev_embedding.copy_(embedding)

    def advance(self):
        self.cache.pos.add_(self.cache.active)


class FlexPromptStep(SharedPromptStep):
    """SharedPromptStep with its attention through FlexAttention (engine/variants/flex_prompt_attention.py): the same
    keys seen, the same result up to rounding. `cache` is the step's view of its first rows, `whole` the cache it is a
    view of (the own part runs over every row of it). Made once per step: each grid cell's position (where row b's
    query sits in the prompt part's layout) and, per window, the lowest key position each query sees."""

    def __init__(self, cache, suffix_keys, whole):
        self.whole = whole
        super().__init__(cache, suffix_keys, whole)

    def _prepare_visibility(self, next_positions):
        c = self.cache
        grid_positions = next_positions.new_zeros(c.pool_k.size(1), c.grid_columns)
        grid_positions[c.prompt_slot, c.sample] = next_positions
        self.lowest = Visibility(lambda window: (grid_positions - window, self.whole.pos - window))

    def attend(self, layer_idx, q, k, v, window):
        c, whole = self.cache, self.whole
        B, _, H, D = q.shape  # (B, 1, H, D)
        self._store_new_keys(layer_idx, k, v)
        lowest, lowest_own = self.lowest(window)
        pool_k, pool_v = c.pool_k[layer_idx].to(q.dtype), c.pool_v[layer_idx].to(q.dtype)
        own_k, own_v = whole.k[layer_idx][:, :, :self.S].to(q.dtype), whole.v[layer_idx][:, :, :self.S].to(q.dtype)
        y = run_flex_prompt_attention(q[:, 0], pool_k, pool_v, c.pool_len, c.prompt_slot, c.sample, lowest, own_k, own_v,
                                      whole.pos, lowest_own)
        return y.reshape(B, H, 1, D)
