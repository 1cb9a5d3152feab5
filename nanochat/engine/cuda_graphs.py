"""
The decode step's shapes and its CUDA graphs: which (rows, keys) shape a step runs (exact, or a bucket that a few
graphs cover), how a shape's step is warmed up, captured and replayed, and the decode modes built from them.

Capture is kept apart from the step, as gpt-fast keeps it: the step (nanochat/engine/decode_batch.py) reads and writes
only tensors of fixed address and does not know it is replayed.
"""

from typing import Callable, NamedTuple, Optional

import torch

from nanochat.errors import SettingError
from nanochat.runtime.device import is_out_of_memory


def exact_shape(rows, keys, max_rows, max_keys):
    """The eager step's shape: exactly the rows in use and the keys they need (no work on free slots)."""
    return rows, keys


# rows of a static step: powers of two and the halfway points between them, so that at most a third of a
# step's rows are free ones (but one row's, in a bucket of 2); keys in multiples of KEY_BUCKET. A 256-row, 256-token rollout uses a few dozen shapes.
# Two rows at least (where the cache has two): the compiled step's graph for every other row count does not serve
# one row (Dynamo specializes a size of 1), so one row alone would cost a graph compiled of its own (~50 s for a d20
# on an H200) and a capture per key bucket, for a rollout's last few steps
ROW_BUCKETS = sorted({2 ** i for i in range(1, 16)} | {3 * 2 ** i for i in range(15)})
KEY_BUCKET = 32
PROMPT_BUCKET = 64  # a static batch's prompt pool is rounded up to this, so that the next rollout can reuse it


def bucket_shapes(max_rows, max_keys):
    """Every shape bucketed_shape gives a step of a cache with max_rows rows and max_keys keys, largest first."""
    rows = {bucketed_shape(r, 1, max_rows, max_keys)[0] for r in range(1, max_rows + 1)}
    keys = {bucketed_shape(1, k, max_rows, max_keys)[1] for k in range(KEY_BUCKET, max_keys + KEY_BUCKET, KEY_BUCKET)}
    return sorted(((r, k) for r in rows for k in keys), key=lambda shape: (shape[0] * shape[1], shape), reverse=True)


def bucketed_shape(rows, keys, max_rows, max_keys):
    """The static step's shape: the smallest row bucket holding `rows` (at most the cache's rows) and `keys`
    rounded up to a multiple of KEY_BUCKET (at most the cache's keys)."""
    row_bucket = next(b for b in ROW_BUCKETS if b >= rows) if rows <= ROW_BUCKETS[-1] else rows  # 2 for 1 row
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
        if is_out_of_memory(error.__context__):
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
        """Run step() (the decode step of `shape`), eagerly or from its graph. Returns whether it captured."""
        replay = self.replays.get(shape)
        if replay is None and shape not in self.seen:
            self.seen.add(shape)
            self.warm_up(step)
            return False
        captured = replay is None
        if captured:
            replay, self.pool = self.capture(step, self.pool)
            self.replays[shape] = replay
        replay()
        return captured

    def prepare(self, shape, step):
        """Warm `shape` up and capture it now, before a rollout needs it (step() runs once, eagerly, on the batch as
        it is: it must leave the batch as it found it). Returns whether it captured (False: it had its graph)."""
        if shape in self.replays:
            return False
        if shape not in self.seen:
            self.seen.add(shape)
            self.warm_up(step)
        self.replays[shape], self.pool = self.capture(step, self.pool)
        return True


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


class DecodePlan(NamedTuple):
    """How a decode mode runs its steps."""
    shape: Callable            # (rows, keys, max_rows, max_keys) -> the step's (rows, keys)
    graphs: Optional[Callable]  # makes the replayer of a batch's steps (GraphedStep), or None: steps run as they are
    static: bool               # a cache whose storage never moves (free rows computed in the step)


def decode_plan(mode):
    """The DecodePlan of a decode mode that runs (see decode_mode)."""
    if mode == "eager":
        return DecodePlan(exact_shape, None, False)
    return DecodePlan(bucketed_shape, GraphedStep if mode == "graph" else None, True)


class GraphsNeedCudaError(SettingError):
    """The decode mode graph on a device that is not CUDA (nanochat.cli's line adds which flags to change)."""

    def __init__(self, decode, device_type):
        super().__init__("decode", f"is {decode}, which replays CUDA graphs, and this run is on {device_type}")
        self.decode, self.device_type = decode, device_type


def check_decode_flag(decode, device):
    """--decode against the device compute_init chose, before anything is built (a model load can take minutes):
    graph replays CUDA graphs, so it needs CUDA (cuda_graphs.decode_mode's rule). Returns the mode that runs."""
    try:
        return decode_mode(decode, device)
    except ValueError:
        raise GraphsNeedCudaError(decode, device.type) from None
