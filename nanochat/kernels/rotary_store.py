"""
What a decode step does to each layer's fresh queries, keys and values before attention, in one kernel a layer:
rotary embedding, the q/k RMSNorm and the generation's q/k scale (CausalSelfAttention.rotate_and_norm), the value
embedding added to v on the layers that have one (its lookup and its gate, ve_gate_scale * sigmoid(ve_gate(h[:ch])),
CausalSelfAttention.project), and the keys and values written into each row's completion storage at its position
(SharedPromptStep._store_new_keys). Returns the queries.

Rounded as the hand-written ops round: rotary's products and sum in the projections' dtype (torch's elementwise ops
on bf16 compute in fp32 and round each result), the norm in fp32 with fp32's epsilon (F.rms_norm's, for bf16 and fp32
inputs alike), its result rounded to the projections' dtype and the scale's product rounded again, or, where autocast
keeps F.rms_norm's result in fp32 (CUDA's autocast from torch 2.12: `norm_fp32`), the scaled norm rounded once; the value embedding's gate rounded
after its matmul, its sigmoid and its scale, its product with the embedding in their promoted dtype, then to v's.
In fp32 every rounding is fp32's.
"""

import functools

import torch
import torch.nn.functional as F

from nanochat.kernels.launch import block_size, kernel, tl

NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default for fp32 and bf16 inputs (computed in fp32)


@functools.lru_cache(maxsize=None)
def _norm_result_dtype(device_type, dtype, autocast_dtype):
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        return F.rms_norm(torch.zeros(1, 2, dtype=dtype, device=device_type), (2,)).dtype


def norm_result_fp32(dtype, device):
    """Whether F.rms_norm of a `dtype` tensor on `device` returns fp32 under the autocast in force (CUDA's autocast
    runs it in fp32 from torch 2.12, a CPU's keeps bf16): asked of torch once per (device, dtype, autocast)."""
    if device.type == "meta" or dtype == torch.float32:
        return True
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return _norm_result_dtype(device.type, dtype, autocast) == torch.float32


@kernel
def _rotary_store_kernel(qkv_ptr, q_out_ptr, cos_ptr, sin_ptr, positions_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                         ve_table_ptr, tokens_ptr, ve_gate_ptr, h_ptr, qk_scale, eps, ve_scale, ve_channels, H, Hkv,
                         qkv_sb, qkv_sh, cos_sp, q_sb, q_sh, kc_sb, kc_sh, kc_sn, vc_sb, vc_sh, vc_sn, ve_sv, gate_sh,
                         h_sb,
                         D: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_VE: tl.constexpr,
                         BLOCK_CH: tl.constexpr, NORM_FP32: tl.constexpr):
    b = tl.program_id(0)  # one row: all its heads, queries (0..H-1), keys (H..H+Hkv-1), then values, as one tile
    h = tl.arange(0, BLOCK_HEADS)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (h < H + 2 * Hkv) & (d < D)
    is_q = h < H
    is_k = (h >= H) & (h < H + Hkv)
    is_v = (h >= H + Hkv) & (h < H + 2 * Hkv)  # not the padded lanes past the last kv head: they have no gate row
    dtype = qkv_ptr.dtype.element_ty
    row = qkv_ptr + b * qkv_sb + h * qkv_sh
    x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
    half = D // 2
    x_partner = tl.load(row + tl.where(d < half, d + half, d - half), mask=ok, other=0.0).to(tl.float32)
    position = tl.load(positions_ptr + b)
    i = tl.where(d < half, d, d - half)
    cos = tl.load(cos_ptr + position * cos_sp + i, mask=d < D, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + position * cos_sp + i, mask=d < D, other=0.0).to(dtype).to(tl.float32)
    sin = tl.where(d < half, sin, -sin)
    rotated = ((x * cos).to(dtype).to(tl.float32) + (x_partner * sin).to(dtype).to(tl.float32)).to(dtype)
    rotated = rotated.to(tl.float32)
    mean_square = tl.sum(rotated * rotated, axis=1) / D  # (BLOCK_HEADS,)
    normed = rotated * (1.0 / tl.sqrt(mean_square + eps))[:, None]
    if not NORM_FP32:
        normed = normed.to(dtype).to(tl.float32)
    y = (normed * qk_scale).to(dtype)
    tl.store(q_out_ptr + b * q_sb + h * q_sh + d, y, mask=ok & is_q)
    pos = tl.load(pos_ptr + b)
    tl.store(k_cache_ptr + b * kc_sb + (h - H) * kc_sh + pos * kc_sn + d, y.to(k_cache_ptr.dtype.element_ty),
             mask=ok & is_k)
    v = x
    if HAS_VE:  # v += (gate * ve).to(v's dtype), gate = scale * sigmoid(ve_gate(h[:ch])) per kv head
        kvh = tl.where(is_v, h - H - Hkv, 0)  # (BLOCK_HEADS, 1)
        ch = tl.arange(0, BLOCK_CH)[None, :]
        channels = tl.load(h_ptr + b * h_sb + ch, mask=ch < ve_channels, other=0.0).to(tl.float32)
        weights = tl.load(ve_gate_ptr + kvh * gate_sh + ch, mask=is_v & (ch < ve_channels), other=0.0)
        logit = tl.sum(channels * weights.to(tl.float32), axis=1)[:, None].to(dtype).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
        gate = (ve_scale * gate).to(dtype).to(tl.float32)
        token = tl.load(tokens_ptr + b)
        embedding = tl.load(ve_table_ptr + token * ve_sv + kvh * D + d, mask=ok & is_v, other=0.0)
        term = (gate * embedding.to(tl.float32)).to(embedding.dtype).to(dtype)  # promoted: the embedding's dtype
        v = (v + term.to(tl.float32)).to(dtype)
    tl.store(v_cache_ptr + b * vc_sb + (h - H - Hkv) * vc_sh + pos * vc_sn + d, v.to(v_cache_ptr.dtype.element_ty),
             mask=ok & is_v)


@torch.library.custom_op("nanochat::rotary_store", mutates_args=("k_cache", "v_cache"))
def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, pos: torch.Tensor, heads: int,
                 qk_scale: float, ve_table: torch.Tensor | None, tokens: torch.Tensor, ve_gate: torch.Tensor | None,
                 h: torch.Tensor, ve_scale: float, norm_fp32: bool) -> torch.Tensor:
    """qkv: (B, heads + 2 Hkv, D) one layer's projections, queries then keys then values; cos, sin: the model's
    (positions, D/2) rotary tables; positions: (B,) each row's absolute position; k_cache, v_cache: the whole
    completion storage (n_layer, B', Hkv, capacity, D), `layer` the one written (the whole storage, not a view of it:
    nanochat/engine/kv_cache.py's store_rows says why); pos: (B,) where each row's key goes. On a layer with a value
    embedding: ve_table (vocab, Hkv * D) its embedding, tokens (B,) the step's tokens, ve_gate (Hkv, ch) the gate's
    weight, h (B, C) the block's normed input, ve_scale the generation's gate scale; else ve_table and ve_gate None.
    norm_fp32: whether F.rms_norm keeps an fp32 result for qkv's dtype here (norm_result_fp32). Returns the queries (B, heads, D), rotated, normed and scaled."""
    B, _, D = qkv.shape
    Hkv = k_cache.size(2)
    q = qkv.new_empty(B, heads, D)
    k_layer, v_layer = k_cache[layer], v_cache[layer]
    has_ve = ve_table is not None
    table, gate = (ve_table, ve_gate) if has_ve else (qkv, qkv)
    _rotary_store_kernel.on(qkv.device)[(B,)](
        qkv, q, cos, sin, positions, k_layer, v_layer, pos, table, tokens, gate, h, qk_scale, NORM_EPS, ve_scale,
        gate.size(1) if has_ve else 0, heads, Hkv, qkv.stride(0), qkv.stride(1), cos.stride(0), q.stride(0),
        q.stride(1), *k_layer.stride()[:3], *v_layer.stride()[:3], table.stride(0), gate.stride(0), h.stride(0),
        D=D, BLOCK_HEADS=block_size(heads + 2 * Hkv, floor=2), BLOCK_D=block_size(D, floor=2), HAS_VE=has_ve,
        BLOCK_CH=block_size(gate.size(1) if has_ve else 1, floor=2), NORM_FP32=norm_fp32)
    return q


@rotary_store.register_fake
def _(qkv, cos, sin, positions, k_cache, v_cache, layer, pos, heads, qk_scale, ve_table, tokens, ve_gate, h, ve_scale,
      norm_fp32):
    return qkv.new_empty(qkv.size(0), heads, qkv.size(2))
