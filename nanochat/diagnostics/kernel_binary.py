"""
The sm_90 (H100/H200) binaries of the Triton decode step's kernels as the engine's real calls bind them, made on this
machine, GPU or not: each launch of a d20 decode step recorded (nanochat/kernels/launch.py's recording_launches: the
step runs on CPU tensors with nothing launched), turned into Triton's compile inputs by Triton's own binder (the code
JITFunction.run specializes a call with: pointer dtypes, ints divisible by 16 or equal to 1, constexprs), compiled
for sm_90 and assembled by Triton's ptxas; then the registers, spills, shared memory and occupancy of each.

Recorded at d20's sizes (n_embd 1280, 10 heads of 128, vocab 65536; 256 rows = 16 prompts x 16 samples over 256
keys, prompts of 128 tokens, T = 1, top-k 50) with RECORDED_LAYERS layers of the smear generation: every launch of a
d20 step binds as one of theirs (short and long windows, value embedding or none, backout's kept sum), each layer's
shapes being the same. Extra variants reach the branches d20 does not take (GQA groups of 2 and 32, greedy, no
top-k, T != 1, autocast's fp32 norm, oct2025's unlimited window). Compiling needs Triton without its interpreter (TRITON_INTERPRET=0 when Python
started): `kernel_binaries` runs this module in a process of its own where the interpreter is on.

    python -m nanochat.diagnostics.kernel_binary [--json]    (the table of docs/performance.md, or the records)
"""

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from nanochat.kernels.launch import recording_launches
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.runtime.dtypes import autocast_context

D20 = dict(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280, window_pattern="SSSL")
RECORDED_LAYERS = 4  # short and long windows, value embeddings on alternate layers, backout keeps layer 2's sum
ROWS, SAMPLES, KEYS, PROMPT_LEN = 256, 16, 256, 128


class Variant(NamedTuple):
    """A decode step recorded: its name, the model's generation and changes to D20, the rollout dtypes, the sampler's
    settings; norm_fp32: rotary_store's norm kept in fp32 for bf16 as CUDA's autocast keeps it from torch 2.12 (a
    CPU's autocast, which the recording runs under, rounds it to bf16 as CUDA's did before); kernels: the kernels
    (function names) it is there for, None for all."""
    name: str
    generation: str
    config: dict
    dtypes: tuple
    temperature: float = 1.0
    top_k: Optional[int] = 50
    norm_fp32: bool = False
    kernels: Optional[tuple] = None


BOTH = (torch.bfloat16, torch.float32)
# the d20 step (the smear generation: every kernel branch a d20 of nanochat's takes), then the branches it lacks
VARIANTS = [Variant("d20", "smear", {}, BOTH),
            Variant("d20 norm fp32", "smear", {}, (torch.bfloat16,), norm_fp32=True),
            Variant("d20 greedy", "smear", {}, BOTH, temperature=0.0),
            Variant("d20 no top-k", "smear", {}, BOTH, top_k=None),
            Variant("d20 T=0.7", "smear", {}, (torch.float32,), temperature=0.7),
            Variant("d20 oct2025", "oct2025", {}, BOTH),
            Variant("GQA group of 2", "smear", dict(n_kv_head=5), BOTH),
            # head dim 128 takes a 4096-wide model, whose norms spill registers (docs/performance.md): its attention
            # only, on 2 layers (a short and a long window)
            Variant("GQA group of 32", "smear", dict(n_head=32, n_kv_head=1, n_embd=4096, vocab_size=8192, n_layer=2),
                    BOTH, kernels=("_prompt_attention_kernel", "_own_keys_kernel"))]

# sm_90 (H100/H200) limits a block's occupancy is computed under
SM90 = dict(sms=132, registers=65536, register_granularity=256, threads=2048, shared=228 * 1024,
            shared_reserved=1024, blocks=32)


def record_decode_launches(generation, dtype, temperature=1.0, top_k=50, **config):
    """The LaunchRecords of one decode step of the engine's Triton step (every kernel it launches, in order) on a CPU
    model of D20's sizes with RECORDED_LAYERS layers (+ `config`), uninitialized weights, decoding in `dtype` (bf16:
    under autocast, as the engine decodes a bf16 rollout; fp32: none)."""
    batch = kernel_step_batch(cpu_model(generation, tuple(sorted(config.items()))), dtype, temperature, top_k)
    with autocast_context(torch.device("cpu"), dtype), recording_launches() as records, torch.no_grad():
        batch.run_step(ROWS, KEYS)
    return records


@functools.lru_cache(maxsize=1)  # the variants in a row that share a model build it once
def cpu_model(generation, config):
    """A GPT of D20's sizes with RECORDED_LAYERS layers and the changes `config` ((field, value) pairs) on the CPU,
    its weights uninitialized (nothing computed from them is read)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**{**D20, "n_layer": RECORDED_LAYERS, **dict(config)}), generation)
    return model.to_empty(device="cpu")


def kernel_step_batch(model, dtype, temperature, top_k):
    """A static DecodeBatch of the engine (its make_batch) running the Triton step: ROWS rows of SAMPLES samples of
    ROWS / SAMPLES prompts, the KV cache in `dtype`. (The one place that names where the engine keeps them.)"""
    from nanochat.engine.cuda_graphs import decode_plan
    from nanochat.engine.decode_batch import RolloutStats
    from nanochat.engine.engine import make_batch, prompt_slots
    from nanochat.engine.scheduler import BatchShape
    from nanochat.engine.decode_steps import decode_step_of

    prompts = ROWS // SAMPLES
    shape = BatchShape(ROWS, prompt_slots(ROWS, SAMPLES, prompts), PROMPT_LEN, KEYS, SAMPLES, dtype=dtype,
                       temperature=temperature, top_k=top_k)
    step = decode_step_of("triton").static_step
    return make_batch(model, shape, decode_plan("static"), RolloutStats(), None, step=step, decode_kernels="triton")


@dataclass(frozen=True)
class Binding:
    """A launch as Triton compiles it: its kernel's name, Triton's signature (`*bf16`, `i32`, `constexpr`...), the
    constexprs' values, the specialization attributes (`tt.divisibility` 16 of a pointer or int), num_warps, grid."""
    kernel: str
    signature: tuple      # ((parameter, type), ...)
    constexprs: tuple     # ((parameter, value), ...)
    attributes: tuple     # ((parameter, (attribute, value), ...), ...)
    num_warps: int
    grid: tuple


def triton_binding(record, backend):
    """The Binding Triton's JITFunction.run makes of `record` (a LaunchRecord) for `backend`: its binder (pointer
    dtypes, ints as i32/i64/constexpr 1, divisibility by 16) and _pack_args, not rules written again here. A pointer's
    divisibility is read from the CPU tensor's address: allocations aligned to 64 bytes there (256 and more on CUDA),
    views offset alike, so by 16 the same answer."""
    from triton.runtime.jit import create_function_from_signature

    jit = record.kernel.on(torch.device("cuda"))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*record.args, **record.kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, record.kwargs, bound, specialization, options)
    names = list(signature)
    return Binding(jit.fn.__name__, tuple(signature.items()),
                   tuple((names[path[0]], value) for path, value in constexprs.items()),
                   tuple((names[path[0]], tuple(tuple(a) for a in attr)) for path, attr in attrs.items() if attr),
                   options.num_warps, grid=tuple(record.grid))


@dataclass
class KernelBinary:
    """One kernel's sm_90 binary for one binding: what ptxas and Triton report, and its occupancy on an H100/H200."""
    kernel: str
    variant: str          # which step made it (VARIANTS' name) and its dtype
    grid: int             # programs (blocks) of the recorded launch
    num_warps: int
    registers: int        # a thread's, ptxas -v
    spill_bytes: int      # stores + loads to local memory
    shared_bytes: int     # static (ptxas) + dynamic (Triton's metadata) shared memory a block
    threads: int
    blocks_per_sm: int
    limited_by: str       # registers, threads, shared memory or blocks
    occupancy: float      # resident warps / 64
    waves: float          # grid / (SMs x blocks_per_sm)
    calls: int            # launches of this binding in the recorded step (RECORDED_LAYERS layers)
    pointers: str         # the float pointers' dtypes, e.g. "bf16 fp32"
    constexprs: dict      # name -> value (ints equal to 1 among them: Triton's specialization)
    triton: str           # the version that compiled it
    not_divisible: list   # the pointers and ints Triton could not take as divisible by 16


def occupancy(registers, threads, shared_bytes, limits=SM90):
    """(blocks a streaming multiprocessor holds, the limit that binds) for a block of `threads` threads using
    `registers` each and `shared_bytes` of shared memory: registers are allocated per warp in units of 256."""
    warps = -(-threads // 32)
    unit = limits["register_granularity"]
    per_warp = -(-registers * 32 // unit) * unit
    by = {"registers": (limits["registers"] // per_warp) // warps if per_warp else limits["blocks"],
          "threads": limits["threads"] // threads,
          "shared memory": limits["shared"] // (shared_bytes + limits["shared_reserved"]),  # 1 KB a block reserved
          "blocks": limits["blocks"]}
    limit = min(by, key=by.get)
    return by[limit], limit


def ptxas_report(ptx):
    """(registers, spill bytes, static shared bytes) Triton's ptxas reports for the sm_90a kernel in `ptx`."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    shared = re.search(r"(\d+) bytes smem", report)
    return registers, spills, int(shared.group(1)) if shared else 0


def compile_binding(record, binding, target, variant, calls):
    """The KernelBinary of `binding` (made from `record`) compiled by Triton for `target`."""
    import triton
    from triton.compiler import ASTSource

    jit = record.kernel.on(torch.device("cuda"))
    names = [name for name, _ in binding.signature]
    constexprs = {(names.index(n),): v for n, v in binding.constexprs}
    attrs = {(names.index(n),): [list(a) for a in attr] for n, attr in binding.attributes}
    source = ASTSource(jit, dict(binding.signature), constexprs, attrs)
    compiled = triton.compile(source, target=target, options={"num_warps": binding.num_warps})
    registers, spills, static_shared = ptxas_report(compiled.asm["ptx"])
    shared = static_shared + compiled.metadata.shared
    threads = 32 * binding.num_warps
    blocks, limit = occupancy(registers, threads, shared)
    grid = 1
    for n in binding.grid:
        grid *= n
    pointers = sorted({t[1:] for _, t in binding.signature if t.startswith("*") and t[1:] in ("bf16", "fp16", "fp32")})
    return KernelBinary(binding.kernel, variant, grid, binding.num_warps, registers, spill_bytes=spills,
                        shared_bytes=shared, threads=threads, blocks_per_sm=blocks,
                        limited_by=limit, occupancy=blocks * binding.num_warps / (SM90["threads"] // 32),
                        waves=grid / (SM90["sms"] * blocks),
                        calls=calls, pointers=" ".join(pointers), constexprs=dict(binding.constexprs),
                        triton=triton.__version__,
                        not_divisible=[n for n, t in binding.signature if t != "constexpr" and not t.startswith("fp")
                         and n not in dict(binding.attributes)])


def distinct_bindings(records, backend):
    """[(record, Binding, launches)] of `records`, one per distinct binding (grid included), in first-launch order."""
    seen = {}
    for record in records:
        binding = triton_binding(record, backend)
        if binding in seen:
            seen[binding][2] += 1
        else:
            seen[binding] = [record, binding, 1]
    return [tuple(v) for v in seen.values()]


def variant_records(variant, dtype):
    """The LaunchRecords of `variant`'s step in `dtype`, as launched on CUDA (norm_fp32: CUDA's autocast's)."""
    records = record_decode_launches(variant.generation, dtype, variant.temperature, variant.top_k, **variant.config)
    if variant.norm_fp32:
        records = [r._replace(kwargs={**r.kwargs, "NORM_FP32": True}) if "NORM_FP32" in r.kwargs else r
                   for r in records]
    return records


def build_binaries(variants=VARIANTS):
    """Every distinct binding of the variants' recorded steps compiled for sm_90: [KernelBinary], each binding once
    (under the first variant that made it). Needs Triton without its interpreter (this process)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    done, binaries = set(), []
    for variant in variants:
        for dtype in variant.dtypes:
            for record, binding, calls in distinct_bindings(variant_records(variant, dtype), backend):
                key = (binding.kernel, binding.signature, binding.constexprs, binding.attributes, binding.num_warps)
                if key in done or variant.kernels is not None and binding.kernel not in variant.kernels:
                    continue
                done.add(key)
                name = f"{variant.name} {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
                binaries.append(compile_binding(record, binding, target, name, calls))
    return binaries


def kernel_binaries(triton_path=None):
    """[dict] of every KernelBinary (build_binaries): compiled here where Triton's interpreter is off and no other
    triton is asked for, else in a process of its own without the interpreter, importing triton from `triton_path`
    (a `pip install --target` directory) where given. Minutes the first time; Triton's cache makes later calls
    quick."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if triton_path is None and not isinstance(tl.standard.sum, InterpretedFunction):
        return [asdict(b) for b in build_binaries()]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    if triton_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(triton_path), env.get("PYTHONPATH")) if p)
    root = Path(__file__).resolve().parents[2]  # the process imports this nanochat, not another installed one
    done = subprocess.run([sys.executable, "-m", "nanochat.diagnostics.kernel_binary", "--json"], env=env, cwd=root,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the sm_90 compile failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


COLUMNS = ("kernel", "variant", "branch", "pointers", "grid", "warps", "registers", "spills", "smem", "blocks/SM",
           "limit", "occupancy", "waves", "calls")


def branches(binaries):
    """What tells each binary's row apart from its kernel's others, as text: the constexprs that differ among them,
    and the arguments not divisible by 16 here alone."""
    out = []
    for b in binaries:
        same = [o.constexprs for o in binaries if o.kernel == b.kernel]
        differ = [k for k, v in b.constexprs.items() if any(o.get(k) != v for o in same)]
        apart = [n for n in b.not_divisible if any(n not in o.not_divisible and n not in o.constexprs
                                                   for o in binaries if o.kernel == b.kernel)]
        out.append(" ".join([f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in b.constexprs.items()
                             if k in differ] + [f"{n} not /16" for n in apart]))
    return out


def markdown_table(binaries):
    """The binaries (KernelBinary or their dicts) as docs/performance.md's table."""
    binaries = [b if isinstance(b, KernelBinary) else KernelBinary(**b) for b in binaries]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for b, branch in zip(binaries, branches(binaries)):
        cells = (b.kernel.strip("_").removesuffix("_kernel"), b.variant, branch, b.pointers, b.grid, b.num_warps,
                 b.registers, b.spill_bytes, b.shared_bytes, b.blocks_per_sm, b.limited_by, f"{b.occupancy:.0%}",
                 f"{b.waves:.2f}", b.calls)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import triton

    built = build_binaries()
    if "--json" in sys.argv:
        print(json.dumps([asdict(b) for b in built]))
    else:
        print(f"triton {triton.__version__}, sm_90, {RECORDED_LAYERS} recorded layers of d20")
        print(markdown_table(built))
