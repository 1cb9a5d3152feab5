"""
How many aten ops, and how many of them kernels, one static decode step (count_decode_step_ops) or any pass run on
the meta device (count_meta_ops: train_count.py's count_train_step_ops counts a training step's pass)
dispatches: the floor a GPU's launch overhead puts under a step (a replayed CUDA graph still runs every kernel),
counted without running anything.

The step runs on the `meta` device (shapes only), so the count is the same on a CPU as on a GPU. A kernel here is
an op that is not a view: views and metadata changes launch nothing. Ops are counted per block of the model, and
outside the blocks (embedding, masks built lazily count in the first block that asks, logits, sampling).
"""

import functools
import traceback
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from nanochat.compiling.functions import CompiledFunction, generated_kernels
from nanochat.engine.decode_batch import DecodeBatch, RolloutStats, static_step
from nanochat.engine.decode_steps import decode_step_of
from nanochat.engine.engine import STATIC_STEP_DYNAMIC
from nanochat.engine.kv_cache import KVCache
from nanochat.engine.shared_prompt_cache import SharedPromptKVCache
from nanochat.engine.variants.triton_step import BLOCK_RANGE


@dataclass
class OpCount:
    ops: int = 0
    kernels: int = 0
    ops_per_block: list = field(default_factory=list)      # (n_layer,) ops dispatched inside each block
    kernels_per_block: list = field(default_factory=list)

    @property
    def ops_outside_blocks(self):
        return self.ops - sum(self.ops_per_block)


def is_view(func):
    """An op whose output aliases its input without writing it: a view, which launches no kernel."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class CountOps(TorchDispatchMode):
    """Counts the ops dispatched, and the ones that are kernels, into `count`, and into the block in `block`.
    device: count only the ops that return a tensor on that device (None: every op)."""

    def __init__(self, count, device=None):
        super().__init__()
        self.count, self.block, self.device = count, None, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "profiler":  # a named range (the kernels' step names its blocks so): no kernel
            self._enter_range(func, args)
            return func(*args, **(kwargs or {}))
        if self.device is not None:
            out = func(*args, **(kwargs or {}))
            if any(isinstance(t, torch.Tensor) and t.device == self.device for t in pytree.tree_leaves(out)):
                self._add(func)
            return out
        self._add(func)
        return func(*args, **(kwargs or {}))

    def _enter_range(self, func, args):
        if func is torch.ops.profiler._record_function_enter_new.default:
            name = args[0] if args else ""
            if name.startswith(BLOCK_RANGE):
                self.block = int(name[len(BLOCK_RANGE):])
        elif self.block is not None and "exit" in func.name():
            self.block = None

    def _add(self, func):
        kernel = not is_view(func)
        self.count.ops += 1
        self.count.kernels += kernel
        if self.block is not None:
            self.count.ops_per_block[self.block] += 1
            self.count.kernels_per_block[self.block] += kernel


def count_decode_step_ops(model, rows, keys, share_prompts=True, prompt_len=64, num_samples=16,
                          temperature=1.0, top_k=50, decode_kernels="torch"):
    """The OpCount of one static decode step of `model` (moved to the meta device: pass a model built there, or
    a copy) over `rows` rows (all in use) reading `keys` keys each. decode_kernels: the decode step
    (nanochat/engine/decode_steps.py: "torch", or "triton", each of its kernels' custom ops one kernel; FlexAttention
    does not run on meta)."""
    model = model.to("meta")
    blocks = list(model.transformer.h)
    count = OpCount(ops_per_block=[0] * len(blocks), kernels_per_block=[0] * len(blocks))
    batch = static_batch(model, rows, keys, share_prompts, prompt_len, num_samples=num_samples, temperature=temperature,
                         top_k=top_k, decode_kernels=decode_kernels)
    mode = CountOps(count)

    def enter(index):
        return lambda module, args: setattr(mode, "block", index)

    hooks = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    hooks += [b.register_forward_hook(lambda module, args, out: setattr(mode, "block", None)) for b in blocks]
    try:
        with mode, torch.no_grad():
            batch.run_step(rows, keys)
    finally:
        for hook in hooks:
            hook.remove()
    return count


def static_batch(model, rows, keys, share_prompts, prompt_len, num_samples, temperature, top_k, decode_kernels="torch"):
    """A static DecodeBatch of `model` (on its device) whose steps can take `rows` rows over `keys` keys, running the
    decode step `decode_kernels` uncompiled: the engine's shared-prompt cache (as many prompt slots as an engine's
    batch of that many rows has) or a copy per row."""
    step = decode_step_of(decode_kernels)
    step.check(share_prompts)
    if share_prompts:
        slots = -(-rows // num_samples) * 2 + 1
        cache = SharedPromptKVCache.for_model(model, rows, slots, prompt_len, keys, rows_per_slot=num_samples,
                                              static=True, step_class=step.cache_step)
    else:
        cache = KVCache.for_model(model, rows, prompt_len + keys)
    return DecodeBatch(model, cache, temperature, top_k, RolloutStats(), step=step.static_step)


def compiled_decode_step_kernels(model, rows, keys, share_prompts=True, prompt_len=64, num_samples=16,
                                 temperature=1.0, top_k=50):
    """What one static decode step of `model` (on its device, not meta: Inductor writes code for a real device)
    over `rows` rows reading `keys` keys each launches, compiled by Inductor as the engine compiles it (dynamic
    shapes): GraphKernels (nanochat/compiling/inductor_code.py), in the unit of count_decode_step_ops' kernels. Compiles
    anew in this process (minutes for a d20 on a CPU)."""
    batch = static_batch(model, rows, keys, share_prompts, prompt_len, num_samples=num_samples, temperature=temperature,
                         top_k=top_k)
    step = CompiledFunction(static_step, STATIC_STEP_DYNAMIC, announce=False)
    batch.step = functools.partial(step, required=True)
    with torch.no_grad():
        batch.run_step(rows, keys)
    return step.kernels[-1]


def compiled_step_graphs():
    """What a call of each graph of the process's compiled static step launches (GraphKernels or None), in order."""
    return generated_kernels(static_step, STATIC_STEP_DYNAMIC)


def compiled_step_kernels(graphs_before=0):
    """What a call of the largest graph of the process's compiled static step launches (GraphKernels): among the
    graphs compiled after the first `graphs_before` (a config's own), or among all where none was (it reused them);
    None where none was counted."""
    kernels = compiled_step_graphs()
    return max((k for k in kernels[graphs_before:] or kernels if k is not None), key=lambda k: k.launches, default=None)


META_READ = "Cannot copy out of meta tensor"  # what a read back to the host raises on the meta device


def count_meta_ops(fn):
    """(the OpCount of the ops fn() dispatches on the meta device, the names of the functions it was in when it
    stopped, innermost last): run until it returns (no names) or first reads a meta tensor back to the host, which
    meta cannot (a pass that reads its sums back once, at its end, is counted whole; the caller checks from the names
    that it stopped there). Ops on other devices (the host's bookkeeping) do not count: a GPU would launch nothing
    for them."""
    count = OpCount()
    try:
        with CountOps(count, device=torch.device("meta")):
            fn()
    except NotImplementedError as error:
        if META_READ not in str(error):
            raise
        return count, [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return count, []
