"""
Token-level inference: the KV cache, sampling, the calculator tool, and the batched rollout engine.

The engine knows nothing about text beyond the special-token ids it needs for the tool state machine:
token ids in, token ids and masks out.
"""

from collections import deque
from dataclasses import dataclass, field

import torch

from nanochat.calculator import format_result, use_calculator


class KVCache:
    """Keys and values of every layer for B rows, each row at its own position.

    k, v: (n_layer, B, T_max, n_kv_head, head_dim)
    pos:  (B,) int64, how many tokens of each row are cached (rows may differ).
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
        self.prev_embedding = (None if embed_dim is None else
                               torch.zeros(batch_size, 1, embed_dim, device=device, dtype=embed_dtype))

    @classmethod
    def for_model(cls, model, batch_size, seq_len, dtype=None):
        """An empty cache shaped for `model`, with the per-row state its generation carries between steps
        (a model without a `generation`, such as a test double, carries none)."""
        cfg, param_dtype = model.config, next(model.parameters()).dtype
        smear = getattr(getattr(model, "generation", None), "smear", False)
        return cls(batch_size, cfg.n_kv_head, seq_len, cfg.n_embd // cfg.n_head, cfg.n_layer, device=model.get_device(),
                   dtype=dtype or param_dtype, embed_dim=cfg.n_embd if smear else None, embed_dtype=param_dtype)

    @property
    def batch_size(self):
        return self.k.size(1)

    @property
    def max_seq_len(self):
        return self.k.size(2)

    def reset(self):
        self.pos.zero_()
        if self.prev_embedding is not None:
            self.prev_embedding.zero_()

    def get_pos(self):
        """The largest row position (equal to every row's position when rows move in lockstep)."""
        return int(self.pos.max())

    def advance(self, num_tokens):
        self.pos += num_tokens

    def rows(self, start, stop):
        """A cache over rows [start, stop) that shares storage with this one (writes land here)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v, view.pos = self.k[:, start:stop], self.v[:, start:stop], self.pos[start:stop]
        view.prev_embedding = None if self.prev_embedding is None else self.prev_embedding[start:stop]
        return view

    def copy_rows(self, dst, src):
        """Row dst[i] becomes a copy of row src[i] (keys, values, position, smear state). dst, src: (N,) long."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.pos[dst] = self.pos[src]
        if self.prev_embedding is not None:
            self.prev_embedding[dst] = self.prev_embedding[src]

    def fill_rows_from(self, start, stop, prompt_cache):
        """Rows [start, stop) become copies of the single row of `prompt_cache` (a prefilled prompt)."""
        length = prompt_cache.max_seq_len
        self.k[:, start:stop, :length] = prompt_cache.k[:, 0:1]
        self.v[:, start:stop, :length] = prompt_cache.v[:, 0:1]
        self.pos[start:stop] = prompt_cache.pos[0]
        if self.prev_embedding is not None:
            self.prev_embedding[start:stop] = prompt_cache.prev_embedding[0:1]


# -----------------------------------------------------------------------------
# Sampling with per-row random streams.
#
# Each row draws its randomness from a counter-based hash of (row seed, step, candidate) instead of a
# shared torch.Generator. A row's tokens then depend only on its own seed and logits, never on which
# other rows share its batch or in what order rows were admitted, and no per-row Python work is needed.

_M32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (xor-shift-multiply). Works on python ints and int64 tensors alike; all
    intermediate products stay below 2**63, so int64 tensors never overflow."""
    x = x & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def row_seed(seed, row_index):
    """The seed of sample `row_index` of a prompt seeded with `seed` (a python int in [0, 2**32))."""
    return mix32(mix32(seed) ^ mix32(row_index + 0x9E3779B9))


def row_uniforms(seeds, steps, num_candidates):
    """Uniforms in (0, 1), shape (B, num_candidates), a pure function of (seed, step, candidate index).
    seeds, steps: (B,) int64."""
    base = mix32(mix32(seeds) ^ steps)  # (B,)
    cand = torch.arange(num_candidates, device=seeds.device, dtype=torch.long)
    bits = mix32(base[:, None] ^ mix32(cand + 0x632BE5AB)[None, :])  # (B, C)
    return ((bits >> 8).float() + 0.5) / float(1 << 24)  # 24 bits: exact in float32, MPS has no float64


def sample_next_token(logits, seeds, steps, temperature=1.0, top_k=None):
    """Sample one token per row. logits: (B, V) float; seeds, steps: (B,) int64 -> (B,) int64.

    temperature 0 is argmax. Otherwise top-k (k > 0) then a draw from softmax(logits / T), done as
    Gumbel-max: argmax(logits/T + Gumbel noise) has exactly that distribution.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1)
    logits = logits.float()
    if top_k is not None and 0 < top_k < logits.size(-1):
        values, indices = torch.topk(logits, top_k, dim=-1)  # (B, k), sorted, so candidate order is stable
    else:
        values, indices = logits, None
    gumbel = -torch.log(-torch.log(row_uniforms(seeds, steps, values.size(-1))))
    choice = torch.argmax(values / temperature + gumbel, dim=-1, keepdim=True)  # (B, 1)
    return (indices.gather(-1, choice) if indices is not None else choice).squeeze(-1)


# -----------------------------------------------------------------------------
# Rollout rows and the per-row tool state machine


@dataclass
class Completion:
    """One sampled continuation of a prompt. tokens exclude the terminal token; masks: 1 = sampled by
    the model, 0 = forced by the tool (calculator output)."""
    tokens: list
    masks: list
    ended: bool = False        # True if the model emitted <|assistant_end|> or <|bos|>; False if cut at max_tokens
    tool_calls: int = 0        # <|python_end|> seen
    tool_successes: int = 0    # ... of which the calculator returned a value


@dataclass
class _Row:
    request: int               # index of the prompt this row belongs to
    sample: int                # index among that prompt's samples
    max_tokens: int
    out: Completion = field(default_factory=lambda: Completion([], []))
    forced: deque = field(default_factory=deque)
    python_tokens: list = None  # collecting a tool call when not None
    steps: int = 0


class _SpecialIds:
    def __init__(self, tokenizer):
        get = tokenizer.encode_special
        self.python_start, self.python_end = get("<|python_start|>"), get("<|python_end|>")
        self.output_start, self.output_end = get("<|output_start|>"), get("<|output_end|>")
        self.assistant_end, self.bos = get("<|assistant_end|>"), tokenizer.get_bos_token_id()


# -----------------------------------------------------------------------------
# The engine


@dataclass
class RolloutStats:
    """Work done by one generate call; used by tests (finished rows cost nothing) and the benchmark."""
    prefill_tokens: int = 0
    decode_forwards: int = 0
    row_steps: int = 0          # sum over decode forwards of the rows in the batch
    max_batch_rows: int = 0


class Engine:
    """KV-cached sampling with the calculator tool.

    `generate`/`generate_batch` are nanochat's one-prompt API. `generate_many` is the batched rollout API:
    many prompts, `num_samples` rows each, decoded together in one KV-cached batch of at most `max_rows`
    rows; each prompt is prefilled once and its cache copied to its rows; finished rows leave the batch at
    once and waiting rows take their place. Row r of a prompt with seed s samples with its own stream
    row_seed(s, r), so its output does not depend on the batch it shares.
    """

    def __init__(self, model, tokenizer, max_rows=None, memory_budget_gb=4.0):
        self.model = model
        self.tokenizer = tokenizer
        self.special = _SpecialIds(tokenizer)
        self.max_rows = max_rows
        self.memory_budget_gb = memory_budget_gb
        self.last_stats = RolloutStats()

    # -- nanochat's API ------------------------------------------------------------
    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42):
        """Yield (token_column, token_masks) per step, one entry per row. A row that has ended keeps
        appearing as <|assistant_end|> with mask 0 until all rows end (nanochat keeps sampling them)."""
        pad = self.special.assistant_end
        for events in self._decode([list(tokens)], num_samples, max_tokens, temperature, top_k, [seed]):
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
        for events in self._decode([list(p) for p in prompts], num_samples, max_tokens, temperature, top_k, seeds,
                                   max_rows=max_rows, emit_finished=True):
            for row in events:
                results[row.request][row.sample] = row.out
            if progress is not None:
                progress(len(events))
        return results

    def rows_for_budget(self, max_seq_len, dtype):
        """How many rows' KV cache fit in the memory budget."""
        cfg = self.model.config
        head_dim = cfg.n_embd // cfg.n_head
        bytes_per_row = 2 * cfg.n_layer * max_seq_len * cfg.n_kv_head * head_dim * torch.tensor([], dtype=dtype).element_size()
        return max(1, int(self.memory_budget_gb * (1 << 30) // bytes_per_row))

    def _cache_dtype(self, device):
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def _decode(self, prompts, num_samples, max_tokens, temperature, top_k, seeds, max_rows=None, emit_finished=False):
        """The decode loop shared by every API. Yields, per step, either [(row, token, mask)] for the rows
        that produced a token (emit_finished=False) or the list of rows that finished (emit_finished=True)."""
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (render_for_completion starts with <|bos|>)")
        model, sp = self.model, self.special
        cfg = model.config
        device = model.get_device()
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = max(1, cfg.sequence_len - longest)
        seq_cap = longest + max_tokens
        dtype = self._cache_dtype(device)
        total_rows = len(prompts) * num_samples
        cap = max_rows or self.max_rows or self.rows_for_budget(seq_cap, dtype)
        B = max(1, min(cap, total_rows))
        cache = KVCache.for_model(model, B, seq_cap, dtype)
        stats = self.last_stats = RolloutStats()

        slots = []                                            # slot i holds slots[i]: _Row; slots are a dense prefix
        next_input = torch.zeros(B, dtype=torch.long, device=device)
        slot_seeds = torch.zeros(B, dtype=torch.long, device=device)
        slot_steps = torch.zeros(B, dtype=torch.long, device=device)
        waiting = deque(range(len(prompts)))                  # prompts not yet (fully) admitted
        pending = None                                        # (request, prefill cache, last logits, next sample)

        def feed(row, sampled_token):
            """Apply one step to a row: a queued forced token wins over the sampled one. Returns
            (token emitted, mask, row finished)."""
            token, mask = (row.forced.popleft(), 0) if row.forced else (sampled_token, 1)
            row.steps += 1
            out = row.out
            if token in (sp.assistant_end, sp.bos):
                out.ended = True
                return token, mask, True
            out.tokens.append(token)
            out.masks.append(mask)
            if token == sp.python_start:
                row.python_tokens = []
            elif token == sp.python_end and row.python_tokens is not None:
                out.tool_calls += 1
                text = format_result(use_calculator(self.tokenizer.decode(row.python_tokens)))
                row.python_tokens = None
                if text is not None:
                    out.tool_successes += 1
                    row.forced.extend([sp.output_start, *self.tokenizer.encode(text), sp.output_end])
            elif row.python_tokens is not None:
                row.python_tokens.append(token)
            return token, mask, row.steps >= row.max_tokens

        def step_rows(rows, sampled, first_slot):
            """Feed sampled tokens to rows occupying slots first_slot...; set their next inputs; retire
            the finished ones. Returns [(row, token, mask)]."""
            events, finished, inputs = [], [], []
            for j, row in enumerate(rows):
                token, mask, done = feed(row, sampled[j])
                events.append((row, token, mask))
                inputs.append(token)
                if done:
                    finished.append(first_slot + j)
            next_input[first_slot:first_slot + len(rows)] = torch.tensor(inputs, dtype=torch.long, device=device)
            retire(finished)
            return events

        def retire(finished_slots):
            """Remove finished rows, keeping the active rows a dense prefix: move the last row into each hole."""
            for i in sorted(finished_slots, reverse=True):
                done_rows.append(slots[i])
                last = len(slots) - 1
                if i != last:
                    src, dst = torch.tensor([last], device=device), torch.tensor([i], device=device)
                    cache.copy_rows(dst, src)
                    for t in (next_input, slot_seeds, slot_steps):
                        t[i] = t[last]
                    slots[i] = slots[last]
                slots.pop()

        def admit():
            """Fill free slots with rows of waiting prompts, prefilling each prompt once; each admitted row
            samples its first token from the prefill logits. Returns their events."""
            nonlocal pending
            events = []
            while len(slots) < B and (pending is not None or waiting):
                if pending is None:
                    request = waiting.popleft()
                    prompt = prompts[request]
                    pcache = KVCache.for_model(model, 1, len(prompt), dtype)
                    ids = torch.tensor([prompt], dtype=torch.long, device=device)
                    logits = model(ids, kv_cache=pcache)[:, -1, :]  # (1, V)
                    stats.prefill_tokens += len(prompt)
                    pending = (request, pcache, logits, 0)
                request, pcache, logits, first = pending
                take = min(B - len(slots), num_samples - first)
                lo, hi = len(slots), len(slots) + take
                cache.fill_rows_from(lo, hi, pcache)
                seeds_list = [row_seed(seeds[request] & _M32, s) for s in range(first, first + take)]
                slot_seeds[lo:hi] = torch.tensor(seeds_list, dtype=torch.long, device=device)
                slot_steps[lo:hi] = 0
                sampled = sample_next_token(logits.expand(take, -1), slot_seeds[lo:hi], slot_steps[lo:hi],
                                            temperature, top_k).tolist()
                slot_steps[lo:hi] = 1
                rows = [_Row(request=request, sample=s, max_tokens=max_tokens) for s in range(first, first + take)]
                slots.extend(rows)
                pending = None if first + take == num_samples else (request, pcache, logits, first + take)
                events += step_rows(rows, sampled, lo)
            return events

        def decode_step():
            n = len(slots)
            logits = model(next_input[:n, None], kv_cache=cache.rows(0, n))[:, -1, :]  # (n, V)
            stats.decode_forwards += 1
            stats.row_steps += n
            stats.max_batch_rows = max(stats.max_batch_rows, n)
            sampled = sample_next_token(logits, slot_seeds[:n], slot_steps[:n], temperature, top_k).tolist()
            slot_steps[:n] += 1
            return step_rows(list(slots), sampled, 0)

        done_rows = []
        events = admit()
        while True:
            if emit_finished:
                if done_rows:
                    yield list(done_rows)
                    done_rows.clear()
            elif events:
                yield events
            if not slots and not waiting and pending is None:
                break
            events = (decode_step() if slots else []) + admit()
