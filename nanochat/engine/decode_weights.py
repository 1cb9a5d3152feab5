"""
The engine's matmul weights in the autocast dtype, made once per rollout instead of at every decode step.
"""

from contextlib import contextmanager

import torch
import torch.nn as nn


def matmul_modules(model):
    """The modules whose fp32 weight autocast casts for a matmul: in nanochat's GPT every nn.Linear (lm_head and
    the gates included); embeddings are looked up and the scalars multiply in fp32."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32]


class DecodeWeights:
    """The model's matmul weights in the autocast dtype, which the engine's forwards use instead of the fp32
    parameters when rollouts run under bf16 or fp16 autocast.

    Autocast casts a matmul's fp32 weight to its dtype at every call, and uses a weight already in that dtype as
    it is: a copy made once gives bitwise the same outputs. Made once because inside a CUDA-graph capture the
    autocast cache is off (see GraphedStep), so a replayed step would cast every weight again: read fp32, write
    and read bf16, three times the bytes of the one bf16 read the step needs. The weights copied are those of
    matmul_modules; tests/test_decode_weights.py checks that autocast casts no other parameter.

    The copies are made at the first low-precision rollout and refreshed in place at the start of every one (the
    trainer changes the fp32 weights in between; in place, so graphs captured over them stay valid). They cost
    2 bytes per matmul weight (d20: 477M weights, 0.95 GB), kept between rollouts and not counted in the KV
    cache's memory_budget_gb: about what autocast's cache held during an eager bf16 rollout anyway. fp32
    rollouts make none. Training never sees them: they replace the parameters only inside `in_use`.
    """

    def __init__(self, model):
        self.model = model
        self.clear()

    @torch.no_grad()
    def refresh(self, dtype):
        """At the start of a rollout under autocast to `dtype` (None: no autocast): copies of the model's current
        fp32 matmul weights, in the storage of the last rollout's when the dtype is the same; none unless the
        dtype is bf16 or fp16."""
        if dtype != self.dtype:
            self.copies = []  # the old ones are freed before the new ones are allocated
            low = dtype in (torch.bfloat16, torch.float16)
            self.slots = [m._parameters for m in matmul_modules(self.model)] if low else []
            self.copies = [torch.empty_like(slot["weight"], dtype=dtype) for slot in self.slots]
            self.dtype = dtype
        for slot, copy in zip(self.slots, self.copies):
            copy.copy_(slot["weight"])

    def clear(self):
        """No copies (the next refresh makes new ones)."""
        self.dtype, self.slots, self.copies = None, [], []  # slots: the Linear modules' parameter dicts

    @contextmanager
    def in_use(self):
        """The model's matmul weights are the copies inside this block. Written into the modules' parameter dicts
        directly: nn.Module.__setattr__ takes only Parameters, and torch.func.functional_call, which swaps every
        weight through the module API, costs over an order of magnitude more per forward than these dict writes."""
        originals = [slot["weight"] for slot in self.slots]
        for slot, copy in zip(self.slots, self.copies):
            slot["weight"] = copy
        try:
            yield
        finally:
            for slot, weight in zip(self.slots, originals):
                slot["weight"] = weight
