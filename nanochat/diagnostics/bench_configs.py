"""
What bench_rl compares: each configuration of chat_rl's step it measures (BenchConfig: nanochat's rollouts or
chat_rl's, the dtype, the decode mode, compiled or not, ...; CONFIGS by name), the chat_rl flags a configuration sets
(PER_CONFIG), those that run at speed on a device (default_configs), and the model shapes --preset names (PRESETS).
"""

from dataclasses import dataclass
from typing import Optional

import torch

from nanochat.compiling.plan import compile_plan
from nanochat.runtime.cpu_features import cpu_has_native_bf16
from nanochat.runtime.distributed import print0


@dataclass(frozen=True)
class BenchConfig:
    name: str
    batched: bool        # chat_rl's rollouts (sample_rollouts), else nanochat's: a generate_batch call per pass
    dtype: torch.dtype   # of rollouts and training (bf16: autocast; weights stay fp32)
    shares_work: bool    # chat_rl's work, else nanochat's (train_on_rollouts' share_prompt and skip_zero_advantage,
    #                      the engine's share_prompts)
    decode: str = "eager"  # the engine's decode mode (nanochat.engine.cuda_graphs.decode_mode): the same tokens in each
    compiled: bool = False  # torch.compile the training forward and (static, graph) the decode step
    blocks: bool = False    # torch.compile each block around its attention instead (--compile=blocks)
    lag: Optional[bool] = None  # the engine's host one step behind the device (None: the engine's default, on CUDA)
    decode_kernels: str = "torch"  # the engine's decode step (nanochat/engine/decode_steps.py: torch, flex, triton)


CONFIGS = {c.name: c for c in [BenchConfig("baseline", False, torch.float32, False),
                                BenchConfig("batched_plain", True, torch.float32, False)]
           + [BenchConfig(f"batched_{short}" + ("" if mode == "eager" else "_" + mode) + "_compiled" * compiled, True,
                          dtype, True, mode, compiled=compiled)
              for compiled in (False, True) for short, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
              for mode in ("eager", "static", "graph")[:3 if short == "bf16" else 2]]
           + [BenchConfig("batched_fp32_blocks", True, torch.float32, True, "eager", blocks=True),
              BenchConfig("batched_bf16_graph_blocks", True, torch.bfloat16, True, "graph", blocks=True),
              BenchConfig("batched_bf16_graph_nolag", True, torch.bfloat16, True, "graph", lag=False),
              BenchConfig("batched_fp32_static_flex", True, torch.float32, True, "static", decode_kernels="flex"),
              BenchConfig("batched_bf16_graph_flex", True, torch.bfloat16, True, "graph", decode_kernels="flex"),
              BenchConfig("batched_bf16_graph_compiled_flex", True, torch.bfloat16, True, "graph", compiled=True,
                          decode_kernels="flex"),
              BenchConfig("batched_fp32_static_triton", True, torch.float32, True, "static", decode_kernels="triton"),
              BenchConfig("batched_bf16_graph_triton", True, torch.bfloat16, True, "graph", decode_kernels="triton")]}
PRESETS = {"d20": dict(depth=20, vocab_size=65536, sequence_len=2048, window_pattern="SSSL")}  # nanochat's d20, Jan 2026
# chat_rl's flags that each config sets (given to bench_rl, they are refused: --configs chooses)
PER_CONFIG = {"dtype": None, "rollout_dtype": "auto", "decode": "auto", "decode_kernels": "auto"}


def default_configs(device, compile_mode="auto"):
    """The configs that run here at speed: graphs on CUDA, bf16 where native, compiled ones as chat_rl's --compile."""
    plans = {c: compile_plan(compile_mode, device, c.decode) for c in CONFIGS.values()}
    configs = [c for c, plan in plans.items() if (c.decode != "graph" or device.type == "cuda")
               and (not c.compiled or (plan.train and (plan.decode or c.decode == "eager"))) and not c.blocks
               and c.lag is None and c.decode_kernels == "torch"]
    if device.type == "cpu" and not cpu_has_native_bf16():
        print0("note: no native bf16 on this CPU (no AVX512-BF16 or AMX): skipping batched_bf16 "
               "(chat_rl runs in fp32 here; --configs=batched_bf16 measures it anyway)")
        return [c for c in configs if c.dtype != torch.bfloat16]
    return configs
