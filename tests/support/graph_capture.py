"""A CPU stand-in for CUDA-graph capture, for GraphedStep (nanochat.engine.cuda_graphs) on machines without a GPU.

`capture_recorded_graph(step, pool)` has capture_cuda_graph's signature and semantics:
- the capture records the step's ops without leaving any effect: the step runs once under a dispatch mode that
  logs every aten op with its arguments, and every storage it writes is restored afterwards;
- a replay runs the logged ops again, on the same tensors the capture saw (buffers, cache, weights: their
  current contents) and with every Python value (shapes, scalars) frozen as it was at the capture; tensors the
  ops themselves produce are recomputed.
So a decode step that takes something from the host that changes between steps of a shape, writes a Python
attribute, or leaves a buffer that is reallocated later, gives different tokens when replayed, here as on a GPU.

What a real capture refuses, the stand-in refuses too (RuntimeError at the capture), as far as a CPU can tell:
- reading a tensor to the host: .item(), int(), float(), bool() (aten ops: _local_scalar_dense, is_nonzero,
  equal) and .tolist(), .numpy(), __array__ (which dispatch no aten op: Tensor's methods are replaced for the
  capture's duration);
- an output whose shape depends on the data: nonzero (torch.where(mask)), masked_select, unique,
  repeat_interleave without output_size, and indexing or index_put_ with a boolean mask (whose nonzero runs
  below the dispatch mode, so the index op is refused when an index is boolean);
- a tensor built from host data inside the step, torch.tensor(list) / as_tensor / from_numpy / indexing with a
  Python list (aten.lift_fresh): on a GPU a copy from pageable host memory, which a capture refuses.
What it cannot tell on a CPU, where every tensor is a host tensor: a CPU tensor made outside the step and read
inside it (on a GPU a host-to-device copy). That is proved by test_static_decode.py's meta-device test, which
runs the step with every tensor on `meta` and fails on any op that touches a tensor of another device."""

from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
# reading a device tensor on the host, or an output shape only the data knows: a CUDA graph capture fails on these
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
              aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
              aten.unique_consecutive.default, aten.repeat_interleave.Tensor}
# a tensor made from host data (torch.tensor(list), as_tensor, from_numpy, x[list]): a copy from pageable memory
HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# indexing ops whose boolean-mask indices are turned into positions by a nonzero below the dispatch mode
MASKABLE = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# reads to the host that dispatch no aten op
HOST_METHODS = ("tolist", "numpy", "__array__")


def _boolean_index(args):
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _refuse(name):
    def refused(*args, **kwargs):
        raise RuntimeError(f"Tensor.{name}() reads a tensor to the host: a CUDA graph capture cannot hold it")
    return refused


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
        if func in HOST_READS or (func in MASKABLE and _boolean_index(args)):
            raise RuntimeError(f"{func} reads a tensor to the host: a CUDA graph capture cannot hold it")
        if func in HOST_DATA:
            raise RuntimeError(f"{func}: a tensor made from host data inside the step (a copy from pageable host "
                               "memory): a CUDA graph capture cannot hold it")
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
    methods = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}
    try:
        for name in HOST_METHODS:
            setattr(torch.Tensor, name, _refuse(name))
        # as capture_cuda_graph: autocast's cast cache off (torch.compile guards on it)
        with recorder, torch.autocast("cpu", enabled=torch.is_autocast_enabled("cpu"),
                                      dtype=torch.get_autocast_dtype("cpu"), cache_enabled=False):
            step()
    finally:  # a capture, refused or not, leaves no effect
        for name, method in methods.items():
            setattr(torch.Tensor, name, method)
        for storage, before in reversed(list(recorder.saved.values())):
            storage.copy_(before)
    return RecordedGraph(recorder.ops).replay, pool


class GraphCounts:
    captures = replays = 0


def use_recorded_graphs(monkeypatch):
    """From now on (in the test), engines made with decode="graph" run on the CPU, their steps replayed from
    recorded graphs. Returns the counts of captures and replays."""
    import nanochat.engine.cuda_graphs as cuda_graphs
    import nanochat.engine.engine as engine
    import nanochat.engine.spec as spec
    from nanochat.engine.cuda_graphs import DecodePlan, GraphedStep, bucketed_shape
    counts = GraphCounts()

    def capture(step, pool):
        replay, pool = capture_recorded_graph(step, pool)
        counts.captures += 1

        def counted():
            counts.replays += 1
            replay()
        return counted, pool

    real_mode, real_plan = spec.decode_mode, engine.decode_plan
    graphed = partial(GraphedStep, capture=capture, warm_up=lambda step: step())  # no streams on a CPU
    graph_anywhere = lambda mode, device: mode if mode == "graph" else real_mode(mode, device)  # noqa: E731
    monkeypatch.setattr(spec, "decode_mode", graph_anywhere)  # resolve_rollout_spec
    monkeypatch.setattr(cuda_graphs, "decode_mode", graph_anywhere)  # check_decode_flag, before anything is built
    monkeypatch.setattr(engine, "decode_plan", lambda mode: DecodePlan(bucketed_shape, graphed, True)
                        if mode == "graph" else real_plan(mode))
    return counts
