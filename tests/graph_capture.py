"""A CPU stand-in for CUDA-graph capture, for GraphedStep (nanochat.cuda_graphs) on machines without a GPU.

`capture_recorded_graph(step, pool)` has capture_cuda_graph's signature and semantics:
- the capture records the step's ops without leaving any effect: the step runs once under a dispatch mode that
  logs every aten op with its arguments, and every storage it writes is restored afterwards;
- a replay runs the logged ops again, on the same tensors the capture saw (buffers, cache, weights: their
  current contents) and with every Python value (shapes, scalars, tensors built from host data) frozen as it
  was at the capture; tensors the ops themselves produce are recomputed.
So a decode step that takes something from the host that changes between steps of a shape, writes a Python
attribute, or leaves a buffer that is reallocated later, gives different tokens when replayed, here as on a GPU.
Ops that read a tensor to the host (what a real capture refuses) raise."""

from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# reading a device tensor on the host: a CUDA graph capture fails on these
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
              torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


def _written_tensors(func, args, kwargs):
    """The tensors an op writes in place (its schema's mutable arguments)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


class _Recorder(TorchDispatchMode):
    """Runs and logs every op; keeps a copy of each storage before its first write."""

    def __init__(self):
        super().__init__()
        self.ops, self.saved = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{func} reads a tensor to the host: a CUDA graph capture cannot hold it")
        for t in _written_tensors(func, args, kwargs):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.saved:
                self.saved[storage.data_ptr()] = (storage, storage.clone())
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """The logged ops of one capture, replayed (see the module docstring)."""

    def __init__(self, ops):
        self.ops = ops  # holding the capture's tensors keeps their ids unique

    def replay(self):
        fresh = {}  # id of a tensor an op produced at the capture -> the one it produces now

        def now(x):
            return fresh.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for func, args, kwargs, out in self.ops:
            result = func(*tree_map(now, args), **tree_map(now, kwargs))
            for then, current in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                if isinstance(then, torch.Tensor):
                    fresh[id(then)] = current


def capture_recorded_graph(step, pool):
    recorder = _Recorder()
    with recorder:
        step()
    for storage, before in reversed(list(recorder.saved.values())):  # a capture leaves no effect
        storage.copy_(before)
    return RecordedGraph(recorder.ops).replay, pool


class GraphCounts:
    captures = replays = 0


def use_recorded_graphs(monkeypatch):
    """From now on (in the test), engines made with decode="graph" run on the CPU, their steps replayed from
    recorded graphs. Returns the counts of captures and replays."""
    import nanochat.cli as cli
    import nanochat.engine as engine
    from nanochat.cuda_graphs import DecodePlan, GraphedStep, bucketed_shape
    counts = GraphCounts()

    def capture(step, pool):
        replay, pool = capture_recorded_graph(step, pool)
        counts.captures += 1

        def counted():
            counts.replays += 1
            replay()
        return counted, pool

    real_mode, real_plan = engine.decode_mode, engine.decode_plan
    graphed = partial(GraphedStep, capture=capture, warm_up=lambda step: step())  # no streams on a CPU
    graph_anywhere = lambda mode, device: mode if mode == "graph" else real_mode(mode, device)  # noqa: E731
    monkeypatch.setattr(engine, "decode_mode", graph_anywhere)
    monkeypatch.setattr(cli, "decode_mode", graph_anywhere)  # the scripts' check of --decode before building
    monkeypatch.setattr(engine, "decode_plan", lambda mode: DecodePlan(bucketed_shape, graphed, True)
                        if mode == "graph" else real_plan(mode))
    return counts
