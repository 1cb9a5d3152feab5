"""
The rows decoded together: admission into free rows of one KV cache, the static decode step, and retirement.

Flow of one token: each row's next input -> the model over a CacheStep of the cache -> logits -> the
sampler (each row its own random stream) -> `sampled` (B, 3) -> one read by the host -> each Row's `feed` (the
calculator's protocol, nanochat/engine/rows.py) -> the token it emits becomes its next input. The next step takes
that input from the host where the host knows it, else from `sampled` on the device: with `lag` the host feeds the
rows one step behind, while the next step runs (DecodeBatch.decode_step).
"""

from dataclasses import dataclass

import torch

from nanochat.engine.cuda_graphs import bucket_shapes, exact_shape
from nanochat.engine.decode_weights import DecodeWeights
from nanochat.engine.kv_cache import KVCache
from nanochat.engine.scheduler import PromptPool, prefilled_prompts
from nanochat.model.attention import run_cached
from nanochat.model.precision import autocast_cache_off
from nanochat.model.sampling import row_seeds, sample_with_logprobs


@dataclass
class RolloutStats:
    """Work done by one generate call; used by tests (finished rows cost nothing) and the benchmark."""
    prefill_tokens: int = 0
    prefill_forwards: int = 0   # prompts go through the model several at a time (DecodeBatch.prefill)
    decode_forwards: int = 0
    row_steps: int = 0          # sum over decode forwards of the rows in the batch
    max_batch_rows: int = 0
    kv_positions_read: int = 0  # cached key/value positions the decode steps' attention read, per layer
    captures: int = 0           # decode shapes captured into CUDA graphs (graph mode), or, in static mode, shapes
                                # a new batch would have captured: 0 once a run's batch is kept
    rows_allocated: int = 0     # rows of the KV cache the call allocated (set before allocating: an
                                # out-of-memory there still tells how many rows were tried)

    def count_step(self, rows, positions_read):
        """A decode forward of `rows` rows in use, its attention reading `positions_read` cached positions a layer."""
        self.kv_positions_read += positions_read
        self.decode_forwards += 1
        self.row_steps += rows
        self.max_batch_rows = max(self.max_batch_rows, rows)


class HostExchange:
    """The decode step's two transfers between host and device: in, the inputs the host knows (one copy a step); out,
    what a step sampled (one copy a step, read once). On CUDA both go through pinned host buffers without blocking
    the host, and the host waits for the copy out by an event: so it waits for the step it reads, not for one
    launched after it. Two buffers in, used in turn: when one is written, the copy that read it last is done (the host
    has since waited for a later copy out). Elsewhere, plain copies."""

    def __init__(self, batch_size, device):
        self.asynchronous = device.type == "cuda"
        self.inputs = [torch.zeros(2, batch_size, dtype=torch.long, pin_memory=self.asynchronous)
                       for _ in range(2 if self.asynchronous else 1)]
        self.turn, self.event = 0, torch.cuda.Event() if self.asynchronous else None
        self.out = torch.zeros(batch_size, 3, dtype=torch.float32, pin_memory=self.asynchronous)

    def send(self, known, tokens, device_inputs):
        """device_inputs[0, :n] = known (1: the host knows row i's next input, tokens[i]); [1, :n] = tokens."""
        host, n = self.inputs[self.turn], len(tokens)
        self.turn = (self.turn + 1) % len(self.inputs)
        host[:, :n] = torch.tensor([known, tokens], dtype=torch.long)
        # the whole buffer (what the free rows' columns hold does not matter): a slice [:, :n] is not contiguous, its
        # copy would go through a pageable temporary, and a copy from pageable memory may wait for the device
        device_inputs.copy_(host, non_blocking=self.asynchronous)

    def fetch(self, sampled, n):
        """Start copying sampled[:n] (what the last step sampled for rows 0..n-1) out; fetched(n) reads it."""
        self.out[:n].copy_(sampled[:n], non_blocking=self.asynchronous)
        if self.event is not None:  # on the stream that copies, whichever device is current
            self.event.record(torch.cuda.current_stream(sampled.device))

    def fetched(self, n, rows):
        """[(token, log-probability under the model, under the sampled distribution)] of `rows` (in their order)
        among the rows 0..n-1 that fetch copied."""
        if self.event is not None:
            self.event.synchronize()
        values = self.out[:n].tolist()  # the step's one read from the device
        return [values[i] for i in rows]


class RowsInFlight:
    """The host's record of a batch's rows in use: rows[i] is in cache row i, the rows in use a dense prefix (the last
    one moves into a finished one's place). A row is any object with `request`, `feed(sampled) -> (token, mask)`,
    `forced_next` and `finished` (a Row; feed also takes the sampled token's log-probabilities). Per row: the absolute
    position of the first key in its own storage (its prompt's length with the prompt held apart, else 0) and the
    keys it holds there (`offset`, `cached`: the step's shape comes from these, never from the device); the steps run
    on it whose samples it has not taken (`unfed`: 0, or 1 when the host lags) and the token it emitted last."""

    def __init__(self, batch_size):
        self.rows = []
        self.offset, self.cached, self.unfed, self.emitted = ([0] * batch_size for _ in range(4))

    def add(self, rows, offset, held):
        """`rows` take the next free rows; each has drawn its first token (as a step would: not yet taken)."""
        lo, hi = len(self.rows), len(self.rows) + len(rows)
        self.rows.extend(rows)
        for host, value in ((self.offset, offset), (self.cached, held), (self.unfed, 1)):
            host[lo:hi] = [value] * (hi - lo)

    def overflow(self, rotary_len, key_capacity):
        """Why the rows' next step cannot run (None: it can)."""
        n = len(self.rows)
        last_position = max(o + c for o, c in zip(self.offset[:n], self.cached[:n]))
        if rotary_len is not None and last_position >= rotary_len:
            return f"KV cache overflow: position {last_position} is past the rotary tables ({rotary_len})"
        if self.keys() > key_capacity:
            return f"KV cache overflow: {self.keys()} positions needed, the cache holds {key_capacity}"
        return None

    def keys(self):
        """The keys the rows' next step reads, its own included."""
        return max(self.cached[:len(self.rows)]) + 1

    def behind(self):
        """The rows a step ran whose samples the host has not fed them."""
        return [i for i in range(len(self.rows)) if self.unfed[i]]

    def inputs(self):
        """(known, tokens): per row, 1 and its next input where the host knows it (what it emitted last once it has
        taken every step; else a tool token it is bound to emit next), or 0 (the device's last sample is its input)."""
        tokens = [self.emitted[i] if self.unfed[i] == 0 else row.forced_next for i, row in enumerate(self.rows)]
        return [int(t is not None) for t in tokens], [t or 0 for t in tokens]

    def stepped(self):
        for i in range(len(self.rows)):
            self.cached[i] += 1
            self.unfed[i] += 1

    def fed(self, i, token):
        self.unfed[i] -= 1
        self.emitted[i] = token

    def remove(self, i):
        """Row i leaves: the last row takes its place."""
        last = len(self.rows) - 1
        for host in (self.rows, self.offset, self.cached, self.unfed, self.emitted):
            host[i] = host[last]
        self.rows.pop()


class DecodeBatch:
    """The rows decoded together, each in a row of one KV cache (a RolloutCache) of B rows.

    in_flight: the rows in use (RowsInFlight's rows: what a row is, there); events are [(row, token, mask)] for the
    rows that emitted a token. Per row of the cache: the token it feeds next, made by the step from `host_inputs`
    and `sampled`; seeds, draws (B,) its random stream (sample_next_token). With a cache that holds
    prompts, each prompt's keys sit once in a prompt slot (`pool`) from its prefill until its last row finishes.

    The decode step (`run_step`) is static: it reads and writes only tensors allocated here or in the cache,
    takes the rows' key counts from the host's own count (RowsInFlight) instead of the device, and runs a
    shape that `shape` chooses: exactly the rows in use and their keys (eager), or buckets that hold free rows
    too (their writes stay in their own row, they never advance), so that a few shapes cover a whole rollout
    and `graphs` can replay them from CUDA graphs. Per step the host reads the sampled tokens once and writes
    the next inputs it knows (forced tool tokens included) in one copy; with `lag`, one step behind (decode_step).
    """

    def __init__(self, model, cache, temperature, top_k, stats, shape=exact_shape, graphs=None, weights=None,
                 step=None, lag=False):
        self.model, self.cache, self.stats = model, cache, stats
        self.weights = weights or DecodeWeights(model)  # never refreshed: the model's own weights
        self.temperature, self.top_k = temperature, top_k
        B, self.device = cache.batch_size, model.get_device()
        self.flight = RowsInFlight(B)
        self.seeds = torch.zeros(B, dtype=torch.long, device=self.device)
        self.draws = torch.zeros(B, dtype=torch.long, device=self.device)  # tokens each row's stream has drawn
        # the decode step's output per row: (token, its log-probability under the model, under the sampled
        # distribution), as float32 (token ids are exact below 2**24) so that the host reads it in one copy
        self.sampled = torch.zeros(B, 3, dtype=torch.float32, device=self.device)
        cache.active.zero_()  # every row free
        self.host_inputs = torch.zeros(2, B, dtype=torch.long, device=self.device)  # (known, token) per row
        self.exchange, self.lag = HostExchange(B, self.device), lag
        self.rotary_len = getattr(model, "rotary_len", None)
        self.shape = shape
        # replays the step from graphs (GraphedStep), or None: run it. Made without a reference to this batch (no
        # bound method kept): a batch in a reference cycle would hold its KV cache until the next garbage collection
        self.graphs = graphs() if graphs else None
        self.pool = PromptPool(cache.prompt_slots) if cache.holds_prompts() else None
        # static_step(batch, rows, keys) or it compiled (nanochat/compiling/functions.py): a function, not a bound method
        self.step = step or static_step

    @property
    def in_flight(self):
        return self.flight.rows

    @property
    def free_rows(self):
        return self.cache.batch_size - len(self.in_flight)

    def begin_rollout(self, stats):
        """A kept batch starts another rollout: its work is counted in `stats` from now on."""
        self.stats = stats

    def prefill(self, requests, prompts, seeds, num_samples):
        """Run `prompts` (lists of ids) through the model in one forward (prefill_forward), each once for all its
        samples; in a cache that holds prompts each prompt's keys go to a free prompt slot. Returns the
        PrefilledPrompts, in order, whose rows `admit` takes."""
        with self.weights.in_use():
            prefill = prefill_forward(self.model, prompts, self.cache.dtype)
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        self.stats.prefill_forwards += 1
        return prefilled_prompts(prefill, requests, prompts, seeds, num_samples, pool=self.pool, cache=self.cache)

    def admit(self, prompt, rows):
        """`rows`, samples prompt.next_samples(free_rows) of `prompt`, take the first free rows, starting from
        the prompt's cache; each draws its first token from the prefill's logits. Returns their events."""
        lo, hi, first = len(self.in_flight), len(self.in_flight) + len(rows), prompt.admitted
        held = self.cache.admit_rows(lo, hi, prompt.cache, prompt.pool_slot, first)
        self.seeds[lo:hi] = row_seeds(prompt.seed, range(first, first + len(rows)), self.device)
        self.draws[lo:hi] = 0
        self.flight.add(rows, prompt.length - held, held)
        prompt.admitted += len(rows)
        self._draw(prompt.logits.expand(len(rows), -1), lo, hi)
        self.draws[lo:hi] += 1
        return self._feed(self.sampled[lo:hi].tolist(), range(lo, hi))

    def decode_step(self):
        """One forward of every row in use on its next input; then the rows take what it sampled and emit. Returns
        their events. With `lag`, the step is launched first and the rows then take what the step before it sampled
        (events one step behind; none after the first): the host feeds them while the device runs this one. A row's
        input comes from the host where the host knows it (a forced tool token, or a row fed up to now), else from the
        step before on the device, so lagging changes no token. A row that ended at the step before was stepped once
        more for nothing (its row freed after); where the rows' next keys might not fit before it is known which
        ended, the rows are fed first instead (no step this call)."""
        n = len(self.in_flight)
        if n == 0:
            return []
        behind = self.flight.behind()
        overflow = self.flight.overflow(self.rotary_len, self.cache.key_capacity)
        if overflow and not behind:
            raise ValueError(overflow)
        if behind:  # copied out before a step overwrites them
            self.exchange.fetch(self.sampled, n)
        if overflow:
            return self._feed(self.exchange.fetched(n, behind), behind)
        self._launch(n)
        if not self.lag:
            self.exchange.fetch(self.sampled, n)
            return self._feed(self.exchange.fetched(n, range(n)), range(n))
        return self._feed(self.exchange.fetched(n, behind), behind) if behind else []

    def _launch(self, n):
        """Run (or replay) the step over rows 0..n-1 (and its shape's free rows), the inputs the host knows first."""
        self.exchange.send(*self.flight.inputs(), self.host_inputs)
        rows, keys = self.shape(n, self.flight.keys(), self.cache.batch_size, self.cache.key_capacity)
        if self.graphs is None:
            self.run_step(rows, keys)
        else:
            self.stats.captures += self.graphs((rows, keys), lambda: self.run_step(rows, keys))
        self.flight.stepped()
        self.stats.count_step(n, self.cache.keys_read(rows, keys))

    def run_step(self, rows, keys):
        """The static decode step (static_step) over rows 0..rows-1 and keys 0..keys-1, as this batch runs it."""
        with self.weights.in_use(), autocast_cache_off():  # one guard state for warm-ups, captures and plain steps
            self.step(self, rows, keys)

    def _draw(self, logits, lo, hi):
        """Rows lo..hi-1 draw from logits (hi - lo, V), each with its own stream, into self.sampled."""
        tokens, model_lp, sampling_lp = sample_with_logprobs(logits, self.seeds[lo:hi], self.draws[lo:hi],
                                                             self.temperature, self.top_k)
        self.sampled[lo:hi] = torch.stack([tokens.float(), model_lp, sampling_lp], dim=1)

    def _feed(self, sampled, rows):
        """`rows` (indices, in use) take their sampled (token, log-probability under the model, under the sampled
        distribution), in order, and emit; what a row emits is its next input once it has taken every step run on
        it, and the finished ones leave. Returns their events."""
        events = []
        for i, (token, model_lp, sampling_lp) in zip(rows, sampled):
            row = self.in_flight[i]
            emitted, mask = row.feed(int(token), (model_lp, sampling_lp))
            events.append((row, emitted, mask))
            self.flight.fed(i, emitted)
        self.retire([i for i, (row, _, _) in zip(rows, events) if row.finished])
        return events

    def retire(self, finished):
        """The rows at indices `finished` leave. The rows in use stay a dense prefix: the last row moves into
        each hole, with its cache row (smear's prev_embedding included), seed, draws and last sample; the
        row it leaves is released."""
        for i in sorted(finished, reverse=True):
            if self.pool is not None:
                self.pool.row_finished(self.in_flight[i].request)
            last = len(self.in_flight) - 1
            if i != last:
                self.cache.copy_rows(i, last)  # ints: an index tensor made on the device waits for the step in flight
                for t in (self.seeds, self.draws, self.sampled):  # sampled: a lagging row's next input
                    t[i] = t[last]
            self.flight.remove(i)
            self.cache.release_row(last)


def prepare_shapes(batch):
    """A new static batch, before its first rollout: with graphs, every shape its steps can take is warmed up and
    captured now, largest first (as vLLM does), so that rollouts only replay; without, the shapes are only counted
    (what a graph run would capture). Counted in stats.captures."""
    shapes = bucket_shapes(batch.cache.batch_size, batch.cache.key_capacity)
    if batch.graphs is None:
        batch.stats.captures += len(shapes)
        return
    for rows, keys in shapes:  # each warm-up runs every row free: nothing moves, nothing is read back
        batch.stats.captures += batch.graphs.prepare((rows, keys), lambda: batch.run_step(rows, keys))


def prefill_forward(model, prompts, dtype):
    """`prompts` (lists of ids) through `model` in one forward, right-padded to the longest: a query never sees the
    padding after it, so each prompt's keys are those of a forward of it alone. Returns a KVCache (in `dtype`) whose
    row i holds prompt i (its position, and smear's state of its own last token, not of the padding), and the logits
    (N, V) at each prompt's last token: no vocabulary-wide work at the other positions."""
    lengths = [len(p) for p in prompts]
    N, L, device = len(prompts), max(lengths), model.get_device()
    ids = torch.zeros(N, L, dtype=torch.long)  # (N, L), padded with token 0
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    ids, last = ids.to(device), torch.tensor(lengths, device=device) - 1  # (N,) each one's last token
    cache = KVCache.for_model(model, N, L, dtype)
    step = cache.step(L, getattr(model, "rotary_len", None))
    hidden = model.hidden_states(ids, step)  # (N, L, C)
    step.advance()
    rows = torch.arange(N, device=device)
    logits = model.logits(hidden[rows, last])  # (N, V)
    cache.pos.copy_(last + 1)
    if cache.prev_embedding is not None:
        cache.prev_embedding.copy_(model.smear_state(ids[rows, last][:, None]))
    return cache, logits


def static_step(batch, rows, keys):
    """The static decode step of `batch` over rows 0..rows-1, attending to keys 0..keys-1 of each: forward, sample
    into batch.sampled, advance the streams of the rows in use. No host read, no shape that depends on data: the
    function that CUDA graphs capture and torch.compile compiles (with dynamic shapes: one graph for every (rows, keys))."""
    known, token = batch.host_inputs[:, :rows]
    inputs = torch.where(known.bool(), token, batch.sampled[:rows, 0].long())  # (rows,): the host's, else the last sample
    logits = run_cached(batch.model, inputs[:, None], batch.cache.decode_step(rows, keys))
    batch._draw(logits[:, -1, :], 0, rows)  # (rows, V)
    batch.draws[:rows] += batch.cache.active[:rows]
