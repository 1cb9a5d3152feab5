"""
The engine's matmul weights in the autocast dtype, made once per rollout instead of at every decode step, and each
attention layer's query, key and value weights concatenated, so that a rollout's forwards make one matmul of the three.
"""

import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn

from nanochat.model.blocks import CausalSelfAttention
from nanochat.model.precision import autocast_enabled


def matmul_modules(model):
    """The modules whose fp32 weight autocast casts for a matmul: in nanochat's GPT every nn.Linear (lm_head and
    the gates included); embeddings are looked up and the scalars multiply in fp32."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32]


def fusable_attention(model):
    """The attention layers whose c_q, c_k, c_v weights can be concatenated (one dtype, one device)."""
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    return [m for m in layers if len({(w.dtype, w.device) for w in qkv_weights(m)}) == 1]


def qkv_weights(attention):
    return [attention.c_q.weight, attention.c_k.weight, attention.c_v.weight]


class DecodeWeights:
    """The weights the engine's forwards use instead of the model's parameters, inside `in_use`:

    - each attention layer's [c_q; c_k; c_v] weights concatenated (its `qkv_weight`): one matmul instead of three,
      and q and k rotated and normed together (CausalSelfAttention). In the rollout's dtype under bf16/fp16 autocast,
      else in the weights' own: then they stand for the model's current weights, copied again whenever one of them
      changed (the parameters' version counters, read on the host), so a DecodeWeights that is never refreshed (a
      DecodeBatch's own) computes with the model as it is. Not used under autocast without low-precision copies:
      that is plain autocast, which casts the separate weights as before.
    - under bf16 or fp16 autocast, the model's matmul weights in that dtype (those of matmul_modules; the c_q, c_k,
      c_v ones are views of the concatenation). Autocast casts a matmul's fp32 weight to its dtype at every call,
      and uses a weight already in that dtype as it is: a copy made once gives bitwise the same outputs. Made once
      because inside a CUDA-graph capture the autocast cache is off (see GraphedStep), so a replayed step would cast
      every weight again: read fp32, write and read bf16, three times the bytes of the one bf16 read the step needs.
      tests/engine/test_decode_weights.py checks that autocast casts no other parameter.

    The low-precision copies are made at the first such rollout and refreshed in place at the start of every one
    (the trainer changes the fp32 weights in between; in place, so graphs captured over them stay valid). They cost
    2 bytes per matmul weight (d20: 477M weights, 0.95 GB), kept between rollouts and not counted in the KV cache's
    memory_budget_gb: about what autocast's cache held during an eager bf16 rollout anyway. fp32 rollouts hold one
    fp32 copy of the q, k, v weights (d20: 98M weights, 0.39 GB). Training never sees any of them: they replace the
    parameters only inside `in_use`.
    """

    def __init__(self, model):
        self.model = model
        self.clear()
        self.refresh(None)  # the concatenations in the weights' own dtype, made now: a step that runs makes none

    @torch.no_grad()
    def refresh(self, dtype):
        """At the start of a rollout under autocast to `dtype` (None: no autocast): copies of the model's current
        fp32 matmul weights, in the storage of the last rollout's when the dtype is the same; none unless the
        dtype is bf16 or fp16. The q, k, v concatenations in that dtype, else in the weights' own."""
        if dtype != self.dtype or self.fused is None or not self._fused_fit():
            self.copies, self.fused = [], None  # the old ones are freed before the new ones are allocated
            low = dtype in (torch.bfloat16, torch.float16)
            self.layers = fusable_attention(self.model)
            self.fused = [torch.empty(sum(w.size(0) for w in qkv_weights(m)), m.c_q.weight.size(1),
                                      dtype=dtype if low else m.c_q.weight.dtype, device=m.c_q.weight.device)
                          for m in self.layers]
            parts = {}  # id of a Linear's parameter dict -> the rows of its layer's concatenation that hold its weight
            for m, fused in zip(self.layers, self.fused):
                rows = 0
                for linear in (m.c_q, m.c_k, m.c_v):
                    parts[id(linear._parameters)] = fused[rows:rows + linear.weight.size(0)]
                    rows += linear.weight.size(0)
            self.slots = [m._parameters for m in matmul_modules(self.model)] if low else []
            self.copies = [parts[id(slot)] if id(slot) in parts else torch.empty_like(slot["weight"], dtype=dtype)
                           for slot in self.slots]
            self.own = [id(slot) not in parts for slot in self.slots]  # copies that are not part of a concatenation
            self.dtype = dtype
        for slot, copy, own in zip(self.slots, self.copies, self.own):
            if own:
                copy.copy_(slot["weight"])
        self._fill_fused()

    def _fill_fused(self):
        for m, fused in zip(self.layers, self.fused):
            rows = 0
            for w in qkv_weights(m):  # cast as autocast casts each weight
                fused[rows:rows + w.size(0)].copy_(w)
                rows += w.size(0)
        # what they were copied from, to tell when the model's own weights change (in place or replaced)
        self.sources = [(weakref.ref(w), w._version) for m in self.layers for w in qkv_weights(m)]

    def _stale(self):
        """Whether a q, k or v weight changed since the concatenations were copied."""
        weights = [w for m in self.layers for w in qkv_weights(m)]
        return any(ref() is not w or version != w._version for (ref, version), w in zip(self.sources, weights))

    def _fused_fit(self):
        """Whether each concatenation still has its weights' rows, columns and device (and their dtype, when it
        stands for them): else a refresh makes new ones."""
        return all(f.shape == (sum(w.size(0) for w in qkv_weights(m)), m.c_q.weight.size(1))
                   and f.device == m.c_q.weight.device and (self.dtype is not None or f.dtype == m.c_q.weight.dtype)
                   for m, f in zip(self.layers, self.fused))

    def clear(self):
        """No copies (the next refresh makes new ones)."""
        self.dtype, self.slots, self.copies, self.own = None, [], [], []  # slots: the Linear modules' parameter dicts
        self.layers, self.fused, self.sources = [], None, []

    def _fused_in_use(self):
        """The concatenations the forwards use now (see the class docstring), refreshed first if stale."""
        if not self.fused:
            return []
        if self.dtype is None:
            device = self.fused[0].device.type
            if autocast_enabled(device):
                return []  # plain autocast: no copies made for it
            if self._stale():
                self.refresh(None)  # in place unless a weight was replaced by one of another shape, device or dtype
        return self.fused

    @contextmanager
    def in_use(self):
        """The model's matmul weights are the copies inside this block, and each attention layer's qkv_weight its
        concatenation. Written into the modules' parameter dicts directly: nn.Module.__setattr__ takes only
        Parameters, and torch.func.functional_call, which swaps every weight through the module API, costs over an
        order of magnitude more per forward than these dict writes."""
        originals = [slot["weight"] for slot in self.slots]
        fused = self._fused_in_use()
        layers = self.layers[:len(fused)]
        previous = [m.__dict__.get("qkv_weight") for m in layers]
        for slot, copy in zip(self.slots, self.copies):
            slot["weight"] = copy
        for m, weight in zip(layers, fused):
            m.qkv_weight = weight
        try:
            yield
        finally:
            for slot, weight in zip(self.slots, originals):
                slot["weight"] = weight
            for m, weight in zip(layers, previous):
                if weight is None:
                    del m.qkv_weight  # the class's None again
                else:
                    m.qkv_weight = weight
