"""
What each kernel of one decode step must do on a GPU, recorded on the `meta` device: the bytes it moves (read and
written), its FLOPs and, for the project's Triton kernels, its grid, threads, registers and the dependent passes a
program makes in turn. nanochat/diagnostics/gpu_model.py turns these into time.

The step runs on `meta` (shapes only, nothing computed) under RecordKernels, a TorchDispatchMode that sees every op:

- an aten op (the hand-written step's, and the matmuls, top-k and embedding of both): bytes from its tensors'
  shapes and dtypes (inputs read, outputs written; a gather reads what it writes, a scatter writes its values only);
  views and allocations launch nothing; FLOPs for the matmuls (2 M N K).
- a custom op of nanochat/kernels/ (one Triton kernel each): `triton_work`, a function of the call's arguments per
  kernel, from the kernel's own loads and stores (a prompt's keys once per program that reads them, each row's own
  keys once, the parts written and read back). What meta cannot know, the prompts' real lengths, comes from the
  Workload.

As CUDA runs it (the engine's bf16 rollouts): the matmul weights are the bf16 copies DecodeWeights makes, and an fp32
input of a matmul is cast to bf16 first (a kernel: autocast's cast), which RecordKernels does where autocast cannot
(it acts on CUDA tensors, not meta ones); the attention's fp32 scores are a bmm writing fp32 (`FP32_BMM_DEVICES`).
"""

from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from nanochat.diagnostics.op_count import is_view
from nanochat.kernels.launch import block_size
from nanochat.kernels.prompt_attention import cells_a_program, own_keys_a_tile, own_splits
from nanochat.model import attention

aten = torch.ops.aten
# aten ops that launch no kernel: their output is metadata (a view under another name) or uninitialised memory
NO_KERNEL = {"_unsafe_view", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "lift_fresh",
             "detach", "alias"}
GATHERS = {"index", "embedding", "gather", "index_select"}  # read what they write (and the indices), not the source
SCATTERS = {"index_put_", "index_put", "index_copy_", "scatter_"}  # write their values into part of a tensor
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}

# Registers a thread of each Triton kernel holds on sm_90: ptxas -v on the code of Triton 3.6.0 (the GPU image's), bf16,
# the d20 variants of tests/support/sm90_compile.py at the commit that split the attention (Triton 3.9.0: 162, 156,
# 124, 137, 22, 48); `prompt_attention_one_kernel`: the one-kernel attention it replaced, 253 under both (commit
# cffe56f). A table until the recorded-signature compile (issue 73, item 3) reports them.
REGISTERS = {"residual_norm": 241, "rotary_store": 165, "own_key_attention": 128, "prompt_attention": 135,
             "relu_square": 19, "sample_rows": 53, "prompt_attention_one_kernel": 253}
WARPS = {"prompt_attention_one_kernel": 8}  # as launched (prompt_attention.attention_warps for 16 rows); the rest 4


@dataclass(frozen=True)
class Workload:
    """One decode step's work: `prompts` x `samples` rows, prompts of `prompt_len` tokens on average (GSM8K's: the
    d20 bench trained 256 rows of ~325 tokens = prompt + 256 completion tokens, docs/performance_history.md) in a
    pool of `prompt_cap` positions (the longest prompt rounded up to 64: cuda_graphs.PROMPT_BUCKET), rollouts of
    `new_tokens` tokens, the compute and cache dtype `dtype`."""
    prompts: int = 16
    samples: int = 16
    prompt_len: int = 69
    prompt_cap: int = 128
    new_tokens: int = 256
    dtype: torch.dtype = torch.bfloat16

    @property
    def rows(self):
        return self.prompts * self.samples


@dataclass(frozen=True)
class KernelWork:
    """One kernel launch: bytes moved, FLOPs; for a Triton kernel its grid (programs), threads and registers a
    program, and the dependent passes each program makes in turn (a load, then the math that needs it); 0 programs:
    a library kernel, taken to fill the device."""
    name: str
    bytes: float
    flops: float = 0.0
    programs: int = 0
    threads: int = 0
    registers: int = 0
    passes: int = 0
    layer: int = -1  # the block it runs in (-1: outside the blocks)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def tensors_in(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def op_name(func):
    """aten.mm.default -> "mm", nanochat::prompt_attention -> "prompt_attention"."""
    return func._schema.name.split("::")[-1]


def matmul_flops(name, inputs):
    """2 M N K (times the batch) of a matmul's (a, b) inputs (addmm/baddbmm: the bias first)."""
    a, b = inputs[-2], inputs[-1]
    if name in ("mm", "addmm"):
        return 2.0 * a.size(0) * a.size(1) * b.size(1)
    return 2.0 * a.size(0) * a.size(1) * a.size(2) * b.size(2)


def aten_work(func, args, kwargs, out):
    """The KernelWork of an aten op's call, or None where it launches no kernel."""
    name = op_name(func)
    if is_view(func) or name in NO_KERNEL:
        return None
    inputs, outputs = tensors_in((args, kwargs)), tensors_in(out)
    if name in GATHERS:  # the source (each one's first tensor) read where the indices point: what is written
        moved = 2 * nbytes(outputs) + nbytes(inputs[1:])
    elif name in SCATTERS:
        moved = 2 * nbytes(inputs[-1:]) + nbytes(inputs[1:-1])  # values read and written, indices read
    else:
        moved = nbytes(inputs) + nbytes(outputs)
    return KernelWork(f"aten.{name}", moved, matmul_flops(name, inputs) if name in MATMULS else 0.0)


def triton_program(name, programs, passes=0):
    """The launch shape of Triton kernel `name`: (programs, threads, registers, passes)."""
    return dict(programs=programs, threads=32 * WARPS.get(name, 4), registers=REGISTERS[name], passes=passes)


def triton_work(name, args, out, workload):
    """The KernelWork of a call of the custom op `name` (nanochat/kernels/) with `args` returning `out`, from its
    kernel's loads and stores (the module docstring)."""
    written = nbytes(tensors_in(out))
    if name == "residual_norm":  # x, delta, y read (B, C), the three results written
        x, delta, y = args[0], args[1], args[4]
        return KernelWork(name, nbytes([t for t in (x, delta, y) if t is not None]) + written,
                          **triton_program(name, -(-x.size(0) // 4)))
    if name == "relu_square":
        return KernelWork(name, nbytes(args[:1]) + written, **triton_program(name, -(-args[0].numel() // 1024)))
    if name == "rotary_store":  # a row's projections read, its queries returned, its key and value written
        qkv, cos, k_cache, ve_table, ve_gate, h = args[0], args[1], args[4], args[10], args[12], args[13]
        B, _, D = qkv.shape
        Hkv = k_cache.size(2)
        cache_rows = 2 * B * Hkv * D * k_cache.element_size()
        tables = 2 * B * (D // 2) * cos.element_size()  # cos and sin at each row's position
        ve = 0 if ve_table is None else (B * Hkv * D * ve_table.element_size() + nbytes([ve_gate]) +
                                         B * ve_gate.size(1) * h.element_size())
        return KernelWork(name, nbytes([qkv]) + written + cache_rows + tables + ve, **triton_program(name, B))
    if name == "sample_rows":  # a row's logits (for the normalizer) and its top-k, in blocks of 1,024 one by one
        logits, values, indices = args[:3]
        B, V = logits.shape
        passes = -(-V // 1024) + (-(-values.size(1) // 1024) if values is not None else 0)
        return KernelWork(name, nbytes([t for t in (logits, values, indices) if t is not None]) + B * 3 * 4,
                          **triton_program(name, B, passes))
    if name == "own_key_attention":
        return own_key_work(args)
    if name == "prompt_attention":
        return prompt_work(args, workload)
    raise ValueError(f"no work model for the custom op {name}: add one to gpu_kernel_work.triton_work")


def own_keys_read(args):
    """(bytes of the rows' own keys and values the attention reads: those its window leaves, FLOPs on them, the
    parts' bytes (written once, read once), own keys seen) of an own_key_attention call's args."""
    q, own_k, _, _, _, _, keys, window, split_keys = args
    B, H, D = q.shape
    seen = min(keys, window + 1)
    splits = own_splits(keys, split_keys)
    return 2 * B * own_k.size(1) * seen * D * own_k.element_size(), 4.0 * B * H * seen * D, \
        splits * B * H * (D + 2) * 4, seen


def own_key_work(args):
    """The own-key kernel: each row's own keys and values once, its queries, its parts written."""
    q, own_k, keys, split_keys = args[0], args[1], args[6], args[8]
    B, H, _ = q.shape
    Hkv = own_k.size(1)
    own, flops, parts, _ = own_keys_read(args)
    tile = own_keys_a_tile(block_size(H // Hkv, floor=1))
    splits = own_splits(keys, split_keys)
    return KernelWork("own_key_attention", nbytes([q]) + own + parts, flops,
                      **triton_program("own_key_attention", B * Hkv * splits, -(-min(split_keys, keys) // tile)))


def prompt_read(args, workload):
    """(bytes of the prompts' keys and values the attention reads: each slot's once per (slot, kv head, chunk)
    program, in tiles of 16 keys; FLOPs on them; programs; tiles a program) of a prompt_attention call's args."""
    q, pool_k = args[0], args[1]
    B, H, D = q.shape
    slots, Hkv = pool_k.shape[:2]
    chunks = -(-args[10] // cells_a_program(block_size(H // Hkv, floor=1)))
    tiles = -(-min(workload.prompt_len, pool_k.size(2)) // 16)
    moved = min(slots, workload.prompts) * Hkv * chunks * 2 * tiles * 16 * D * pool_k.element_size()
    return moved, 4.0 * B * H * tiles * 16 * D, slots * Hkv * chunks + -(-B // 16), tiles


def prompt_work(args, workload):
    """The prompt and merge kernel: the prompts once per program, the rows' queries and parts read, output written."""
    q, part_top, part_acc = args[0], args[5], args[7]
    prompt, flops, programs, tiles = prompt_read(args, workload)
    moved = prompt + 2 * nbytes([q]) + 2 * nbytes([part_top]) + nbytes([part_acc])
    return KernelWork("prompt_attention", moved, flops,
                      **triton_program("prompt_attention", programs, tiles + part_top.size(0)))


def one_kernel_work(own_args, prompt_args, workload):
    """The attention as one kernel (before the split, commit cffe56f), from the two calls' args: the same prompt and
    own reads, no parts; one program per (slot, kv head, chunk) walks its 16 rows' own keys 2 a pass."""
    q = own_args[0]
    own, own_flops, _, seen = own_keys_read(own_args)
    prompt, prompt_flops, programs, tiles = prompt_read(prompt_args, workload)
    return KernelWork("prompt_attention_one_kernel", own + prompt + 2 * nbytes([q]), own_flops + prompt_flops,
                      **triton_program("prompt_attention_one_kernel", programs, tiles + -(-seen // 2)))


class RecordKernels(TorchDispatchMode):
    """Records the KernelWork of every kernel the ops dispatched under it launch, in order, into `kernels`, each with
    the block it ran in (nanochat/kernels/decode_step.py's and the blocks' forward hooks set `layer`).
    one_kernel_attention: the Triton step's attention recorded as the one kernel it was before the split."""

    def __init__(self, workload, one_kernel_attention=False):
        super().__init__()
        self.workload, self.one_kernel = workload, one_kernel_attention
        self.kernels, self.layer, self.own_args = [], -1, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            return func(*args, **kwargs)
        name = op_name(func)
        if name in MATMULS and func.namespace == "aten" and self.workload.dtype != torch.float32:
            args = tuple(self._autocast(a) for a in args)
        out = func(*args, **kwargs)
        if func.namespace == "nanochat":
            work = self._triton(name, args, out)
        else:
            work = aten_work(func, args, kwargs, out)
        if work is not None:
            self.kernels.append(KernelWork(**{**work.__dict__, "layer": self.layer}))
        return out

    def _triton(self, name, args, out):
        if not self.one_kernel or name not in ("own_key_attention", "prompt_attention"):
            return triton_work(name, args, out, self.workload)
        if name == "own_key_attention":
            self.own_args = args  # recorded with the prompt part, as one kernel
            return None
        return one_kernel_work(self.own_args, args, self.workload)

    def _autocast(self, t):
        """An fp32 input of a matmul cast to the compute dtype, as CUDA's autocast casts it (a kernel)."""
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            return t
        cast = aten._to_copy.default(t, dtype=self.workload.dtype)
        self.kernels.append(KernelWork("aten._to_copy (autocast)", nbytes([t, cast]), layer=self.layer))
        return cast


@contextmanager
def as_on_cuda():
    """The attention's fp32 scores computed on `meta` as on CUDA: a bmm writing fp32 (attention.FP32_BMM_DEVICES),
    not fp32 copies of the keys (a CPU's way)."""
    with mock.patch.object(attention, "FP32_BMM_DEVICES", attention.FP32_BMM_DEVICES + ("meta",)):
        yield
