"""
The batched rollout engine: prompts in, sampled completions out, with the calculator tool run in between.

One rollout, top-down through the modules:
    engine.py               Engine: nanochat's generate / generate_batch, and generate_many for rollouts
    memory.py               the memory an engine holds between rollouts and gives back, and how one of its rollouts
                            backs off when it runs out (RolloutMemory, engine.memory)
    spec.py                 RolloutSpec, what an Engine is built from, resolved once (decode mode, compiled step,
                            dtype, rows, ...; rollout_spec), and how much memory the rollout's KV caches may take
    scheduler.py            the static batches kept between rollouts, a rollout's prompts on their way in, and the
                            prompt slots that hold them
    decode_batch.py         the rows decoded together: prefill, admission, the static decode step, retirement
    decode_steps.py         the decode steps it can run, by name (torch, flex, triton; --decode-kernels), in one table
    kv_cache.py             the cache each row keeps its own keys and values in, and the RolloutCache contract
    shared_prompt_cache.py  the cache where rows share their prompt's keys and values
    variants/               the decode step's variants: flex_prompt_attention.py (its shared-prompt attention
                            through FlexAttention, for benchmarks), triton_step.py (the whole step in the project's
                            Triton kernels, nanochat/kernels/)
    decode_weights.py       the matmul weights in the autocast dtype, made once per rollout
    cuda_graphs.py          the step's shapes, and its CUDA graphs (captured once, replayed)
    rows.py                 one sample in flight, and the calculator tool's protocol
    calculator.py           the calculator itself

`from nanochat.engine import Engine, KVCache, sample_next_token, use_calculator` is nanochat's import path (its
engine.py); what differs from nanochat's objects is in docs/layout.md, "nanochat's names". sample_next_token here is
nanochat's signature (logits, rng, temperature, top_k), not nanochat.model.sampling's (logits, seeds, steps, ...).
"""

from nanochat.engine.calculator import use_calculator
from nanochat.engine.engine import Engine
from nanochat.engine.kv_cache import KVCache
from nanochat.model.sampling import sample_with_generator as sample_next_token

__all__ = ["Engine", "KVCache", "sample_next_token", "use_calculator"]
