"""
One transformer block of the GPT (nanochat/model/gpt.py, whose docstring says what each generation computes): its
attention's projections (rotary, QK RMSNorm and scale, the value embeddings' gate), its MLP, and the two regions
around its attention (BlockRegions), which --compile=blocks compiles once for every layer; with the weightless
RMSNorm and the embeddings' smear, which the model applies too.
"""

from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.model.generations import SMEAR_GATE_CHANNELS, has_value_embedding
from nanochat.model.rotary import apply_rotary


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def smear(x, smear_gate, smear_lambda, previous=None):
    """x: (B, T, C) normed embeddings -> each position t >= 1 plus gate_t * x[t - 1], gate_t =
    smear_lambda * sigmoid(smear_gate(x_t[:24])); position 0 likewise with `previous` when given (the
    token before it, e.g. from a KV cache), else left alone."""
    def gate(e):
        return smear_lambda * torch.sigmoid(smear_gate(e[..., :SMEAR_GATE_CHANNELS]))
    first = x[:, :1] if previous is None else x[:, :1] + gate(x[:, :1]) * previous
    if x.size(1) == 1:
        return first
    return torch.cat([first, x[:, 1:] + gate(x[:, 1:]) * x[:, :-1]], dim=1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx, generation):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.qk_scale = generation.qk_scale
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.ve_gate = None
        if has_value_embedding(generation, layer_idx, config.n_layer):
            self.ve_gate_channels, self.ve_gate_scale = generation.ve_gate_channels, generation.ve_gate_scale
            self.ve_gate = nn.Linear(self.ve_gate_channels, self.n_kv_head, bias=False)

    # [c_q; c_k; c_v].weight concatenated ((n_head + 2 n_kv_head) * head_dim, n_embd), or None: set by the engine's
    # DecodeWeights.in_use only (nanochat/engine/decode_weights.py), so that a rollout's forwards make one matmul of the
    # three and rotate and norm q and k together; training keeps the three Linears (and the state dict its keys)
    qkv_weight = None

    def project(self, x, ve, rope):
        """x: (B, T, C), the block's normed input; ve: None or this layer's value embeddings (B, T, n_kv_head *
        head_dim); rope: a Rotary -> this layer's queries (B, T, H, D), keys and values (B, T, Hkv, D), rotated
        and normed, for the attention context (nanochat/model/attention.py) to attend over the keys it holds and
        these."""
        B, T, C = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight).view(B, T, H + 2 * Hkv, D)
            qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]  # (B, T, H + Hkv, D), (B, T, Hkv, D)
        else:
            q, k, v = self.c_q(x).view(B, T, H, D), self.c_k(x).view(B, T, Hkv, D), self.c_v(x).view(B, T, Hkv, D)
        if ve is not None:
            gate = self.ve_gate_scale * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate_channels]))  # (B, T, n_kv_head)
            v = v + (gate.unsqueeze(-1) * ve.view(B, T, Hkv, D)).to(v.dtype)
        if self.qkv_weight is not None:  # every op below acts on each head alone: q's and k's heads go through at once
            qk = self.rotate_and_norm(qk, rope, v.dtype)
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            q, k = self.rotate_and_norm(q, rope, v.dtype), self.rotate_and_norm(k, rope, v.dtype)
        return q, k, v

    def rotate_and_norm(self, x, rope, dtype):
        """Queries or keys (B, T, heads, D) -> rotated, QK-normed, scaled, in `dtype`. Autocast runs rms_norm in
        fp32; attention runs in the projections' dtype (bf16 under autocast), so a bf16 KV cache is read as it is
        instead of being converted to fp32 at every layer of every step."""
        x = norm(apply_rotary(x, rope))
        if self.qk_scale != 1.0:  # after the norm, as nanochat does, so the rounding matches
            x = x * self.qk_scale
        return x.to(dtype)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx, generation):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx, generation)
        self.mlp = MLP(config)

    def forward(self, x, ve, rope, window, context, regions=None):
        """x: (B, T, C) -> the block's output. The attention context attends by layer index and window, Python
        ints that differ from layer to layer; the two regions around it (BlockRegions) take neither, so that one
        compile of each serves every layer (--compile=blocks)."""
        regions = regions or EAGER_REGIONS
        q, k, v = regions.before_attention(self, x, ve, rope)
        y = context.attend(self.attn.layer_idx, q, k, v, window)  # (B, H, T, D)
        return regions.after_attention(self, x, y)


def block_before_attention(block, x, ve, rope):
    """A block's queries, keys and values of its input x (CausalSelfAttention.project of the normed x)."""
    return block.attn.project(norm(x), ve, rope)


def block_after_attention(block, x, y):
    """A block's output from its input x (B, T, C) and its attention's y (B, H, T, D): the projection added to the
    residual, then the MLP's."""
    B, T, C = x.shape
    x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
    return x + block.mlp(norm(x))


class BlockRegions(NamedTuple):
    """What a block runs before and after its attention: block_before_attention and block_after_attention, or
    their compiled versions (nanochat/compiling/plan.py's compile_block_regions)."""
    before_attention: Callable
    after_attention: Callable


EAGER_REGIONS = BlockRegions(block_before_attention, block_after_attention)
