"""
Every load and store of a Triton kernel run in Triton's interpreter, checked inside the extent of the tensor argument
its pointer derives from (tests only).

A kernel's tensor arguments reach the interpreter as pointer handles (their data_ptr); this harness tags each with its
argument's name and carries the tag through every builder op that makes a pointer from a pointer (addptr, splat,
broadcast, expand_dims, reshape, trans, select, cat, join). At each load and store, every address the mask lets
through must lie, with its element's width, inside the extent of the argument(s) its tag names: the bytes from the
tensor's lowest to its highest element (a view: its own span, not its storage's). A violation raises OutOfBounds
naming the kernel, the program, the argument, the offending offset (in elements from the tensor's first) and the
extent. A pointer that lost its tag (made through an op this file does not follow) fails too: the harness must be
taught that op, not guess.

It also counts each launch's stores per element (Launch.write_counts), so that a test can say "every element of the
output written exactly once" (a free row left unwritten, two programs writing one row).

    with checked_memory() as memory:
        out = some_op(...)            # its kernels run in the interpreter, checked
    memory.launches[-1].kernel       # '_some_kernel'
"""

import contextlib
import inspect
from dataclasses import dataclass, field

import numpy as np
from triton.runtime import interpreter

TAG = "bounds_harness_args"  # the TensorHandle.attr key: the frozenset of argument names a pointer derives from
# builder ops that make a pointer from pointers: (method, the positions of its pointer operands after self)
POINTER_OPS = (("create_addptr", (0,)), ("create_splat", (1,)), ("create_broadcast", (0,)),
               ("create_expand_dims", (0,)), ("create_reshape", (0,)), ("create_trans", (0,)),
               ("create_select", (1, 2)), ("create_cat", (0, 1)), ("create_join", (0, 1)))


class OutOfBounds(AssertionError):
    """A kernel's load or store outside its argument's extent."""


@dataclass(frozen=True)
class Extent:
    """The bytes [start, end) of a tensor argument, and where its first element is (offsets are counted from there)."""
    name: str
    base: int
    start: int
    end: int
    itemsize: int

    def describe(self):
        first, last = (self.start - self.base) // self.itemsize, (self.end - self.base) // self.itemsize
        return f"elements [{first}, {last}) of {self.itemsize}-byte items"


def extent_of(name, tensor):
    """The extent of `tensor` (any strides, a view's own span): from its lowest element to its highest."""
    itemsize, base = tensor.element_size(), tensor.data_ptr()
    if tensor.numel() == 0:
        return Extent(name, base, base, base, itemsize)
    low = sum(min(0, (n - 1) * s) for n, s in zip(tensor.shape, tensor.stride()))
    high = sum(max(0, (n - 1) * s) for n, s in zip(tensor.shape, tensor.stride()))
    return Extent(name, base, base + low * itemsize, base + (high + 1) * itemsize, itemsize)


@dataclass
class Launch:
    """One kernel launch: its tensor arguments' extents, and the element offsets its stores wrote, per argument."""
    kernel: str
    extents: dict
    by_id: dict
    stores: dict = field(default_factory=dict)
    accesses: int = 0

    def write_counts(self, name):
        """(elements of the argument's extent,) int: how many times the launch stored to each."""
        extent = self.extents[name]
        counts = np.zeros((extent.end - extent.start) // extent.itemsize, dtype=np.int64)
        for addresses in self.stores.get(name, []):
            np.add.at(counts, (addresses - extent.start) // extent.itemsize, 1)
        return counts


class Memory:
    """The launches seen inside one checked_memory block, newest last."""

    def __init__(self):
        self.launches = []

    def launch(self, kernel):
        """The last launch of the kernel named `kernel`."""
        found = [launch for launch in self.launches if launch.kernel == kernel]
        assert found, f"no launch of {kernel} (launched: {sorted({launch.kernel for launch in self.launches})})"
        return found[-1]


def _tag(handle):
    return handle.attr.get(TAG) if hasattr(handle, "attr") else None


def _check(memory, kind, ptrs, mask):
    """Every address of `ptrs` where `mask` holds inside the extent of an argument its tag names."""
    launch = memory.launches[-1]
    program = interpreter.interpreter_builder.grid_idx
    names = _tag(ptrs)
    if not names:
        raise OutOfBounds(f"{launch.kernel} (program {program}): a {kind} through a pointer the bounds harness cannot "
                          f"trace to an argument (teach tests/support/bounds_harness.py the op that made it)")
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    addresses = addresses.ravel().astype(np.int64)
    width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    inside = np.zeros(addresses.shape, dtype=bool)
    for name in names:
        extent = launch.extents[name]
        inside |= (addresses >= extent.start) & (addresses + width <= extent.end)
    launch.accesses += addresses.size
    if not inside.all():
        extent = launch.extents[sorted(names)[0]]
        bad = addresses[~inside]
        offset = (int(bad[0]) - extent.base) / extent.itemsize
        raise OutOfBounds(f"{launch.kernel} (program {program}): a {kind} of argument {'/'.join(sorted(names))} at "
                          f"element offset {offset:g} outside its extent ({extent.describe()}); {bad.size} such "
                          f"lane(s) in this access")
    if kind == "store":
        (name,) = names  # a store through a pointer of two arguments' would need per-lane provenance
        launch.stores.setdefault(name, []).append(addresses)


def _carrying_tags(original, positions):
    """A builder op that tags its result with the union of its pointer operands' tags."""
    def op(self, *args):
        result = original(self, *args)
        tags = [_tag(args[i]) for i in positions]
        tags = [t for t in tags if t]
        if tags:
            result.attr[TAG] = frozenset().union(*tags)
        return result
    return op


@contextlib.contextmanager
def checked_memory():
    """Within the block every kernel launched in Triton's interpreter has its loads and stores checked (the module
    docstring); yields the Memory that records the launches."""
    memory = Memory()
    builder = interpreter.InterpreterBuilder
    originals = {name: getattr(builder, name) for name, _ in POINTER_OPS}
    originals.update(create_masked_load=builder.create_masked_load, create_masked_store=builder.create_masked_store)
    init_args, implicit_cvt = interpreter.GridExecutor._init_args_hst, interpreter._implicit_cvt

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        bound = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
        tensors = {name: value for name, value in bound.items() if hasattr(value, "data_ptr")}
        memory.launches.append(Launch(self.fn.__name__, {n: extent_of(n, t) for n, t in tensors.items()},
                                      {id(t): n for n, t in tensors.items()}))
        return args_hst, kwargs_hst

    def tagged_cvt(arg):
        converted = implicit_cvt(arg)
        name = memory.launches[-1].by_id.get(id(arg)) if memory.launches else None
        if name is not None:
            converted.handle.attr[TAG] = frozenset([name])
        return converted

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        _check(memory, "load", ptrs, mask)
        return originals["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check(memory, "store", ptrs, mask)
        return originals["create_masked_store"](self, ptrs, value, mask, cache_policy)

    try:
        for name, positions in POINTER_OPS:
            setattr(builder, name, _carrying_tags(originals[name], positions))
        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        interpreter.GridExecutor._init_args_hst, interpreter._implicit_cvt = init_args_hst, tagged_cvt
        yield memory
    finally:
        for name, original in originals.items():
            setattr(builder, name, original)
        interpreter.GridExecutor._init_args_hst, interpreter._implicit_cvt = init_args, implicit_cvt

