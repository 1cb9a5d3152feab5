"""
Attention, for training and for the KV caches, and the one contract between the model and whatever holds keys
and values for it.

Windows. A layer with window w lets a query at position p see key j iff j <= p and p - j <= w: w tokens of
left context plus itself (nanochat/model/gpt.py says which layer has which window).

The contract. The model computes each layer's queries, keys and values and hands them to an attention context:

    context.attend(layer_idx, q, k, v, window) -> (B, H, T, D)
        q: (B, T, H, D); k, v: (B, T, Hkv, D), H a multiple of Hkv (grouped-query attention). The context
        returns the attention of these queries over the keys it holds (none, a shared prompt's, a cache's)
        followed by these new ones, under the layer's window.

The model never asks how keys are stored, and never calls back into what schedules it. Contexts:
- `SequenceAttention`: a plain sequence at positions 0..T-1 (training, nanochat's forward);
- `SharedPrefixAttention`: training rows that continue prompts (one, or several right-padded; their keys recorded
  once);
- a KV cache's `CacheStep` (nanochat/engine/kv_cache.py, nanochat/engine/shared_prompt_cache.py): one forward of T new
  tokens per row over what each row of the cache holds. A CacheStep also carries what a cached forward needs
  besides attention: `positions` (B, T), the new tokens' absolute positions (rotary reads them: they are an
  explicit input of the forward, as gpt-fast's input_pos), and the smear state of the generations that mix
  the previous token's embedding into the next (`smear_previous`, `keep_smear_state`). The caller builds the
  step from the cache, runs the model on it and then advances the cache (`run_cached`); the model does neither.

Each context builds a window's visibility once per forward, at its first layer, and reuses it in the others.
"""

import math
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from nanochat.model.precision import without_autocast

# explicit_attention's reach in keys, eagerly: it reads and writes (T, keys) scores and probabilities where the
# fused kernel streams them, so long sequences lose (compiled, Inductor fuses them). Eagerly, on a CPU with native
# bf16 (forward + backward of a training batch), it beats the fused kernel on rows of 128 tokens and is slower on
# rows of 512: this limit lies between
EXPLICIT_MAX_KEYS = 256


def attend(q, k, v, mask):
    """Scaled dot-product attention. q: (B, T, H, D); k, v: (B, Tk, Hkv, D) with H a multiple of Hkv (GQA);
    mask: None = causal over T == Tk, else bool broadcastable to (B, H, T, Tk), True = visible.
    Returns (B, H, T, D). Several bf16 queries per row on a CPU (training, prefill) go through explicit_attention
    (see there), eagerly over at most EXPLICIT_MAX_KEYS keys, compiled over any number: a length limit there would
    be a guard, and the first longer row (a completion run to 256 tokens after its prompt) a new graph compiled
    mid-run, the run waiting on it. Everything else, a decode step's single query included,
    goes through PyTorch's fused kernel."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.size(1) > 1 and (
            torch.compiler.is_compiling() or k.size(1) <= EXPLICIT_MAX_KEYS):
        return explicit_attention(q, k, v, mask)
    # `not ... ==`, which Dynamo evaluates to a Python bool under dynamic shapes: `!=` (and bool() or int() of it)
    # stayed symbolic, which SDPA refuses (the compiled copy-cache decode step failed on it, torch 2.11 and 2.13)
    gqa = not (k.shape[2] == q.shape[2])
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          is_causal=mask is None, enable_gqa=gqa)


def explicit_attention(q, k, v, mask):
    """attend() written out: fp32 scores (fp32_scores), fp32 softmax, probabilities rounded to v's dtype for the
    weighted sum, as a fused kernel computes in bf16. Same arguments and result as attend().
    Why on a CPU in bf16, for several queries a row: PyTorch's fused CPU kernel is slow there at training's shapes,
    its backward above all: written out, a chat_rl step's compiled training pass is markedly faster on a CPU with
    native bf16 (Inductor fuses the mask and softmax around two matmuls; docs/performance.md). Not for one query a row
    (a decode step): there the fused kernel is faster, this one spending most of its time upcasting the keys. It keeps
    the (B, H, T, Tk) probabilities for the backward where the fused kernel keeps O(T) per row: 16 MB a layer for 4
    rows x 4 heads x 512 x 512, fine at the model sizes CPUs train."""
    B, T, H, D = q.shape
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H(kv), T(k), D)
    if not (k.shape[1] == H):  # grouped-query attention: each kv head serves H // Hkv query heads
        k, v = k.repeat_interleave(H // k.size(1), dim=1), v.repeat_interleave(H // v.size(1), dim=1)
    scores = fp32_scores(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(D))  # (B, H, T, Tk) fp32
    if mask is None:  # causal: key j visible from query i iff j <= i
        mask = torch.ones(T, k.size(2), dtype=torch.bool, device=q.device).tril()
    probs = torch.where(mask, scores, float("-inf")).softmax(dim=-1)
    return probs.to(v.dtype) @ v


def window_mask(query_pos, num_keys, window):
    """query_pos: (..., T) int64 -> bool (..., T, num_keys): key j visible iff 0 <= p - j <= window."""
    delta = query_pos[..., :, None] - torch.arange(num_keys, device=query_pos.device)
    return (delta >= 0) & (delta <= window)


def sequence_mask(T, window, device):
    """The mask of a sequence at positions 0..T-1 under `window`: None (plain causal, the fast kernel) when the
    window reaches back to position 0 from every query, else bool (T, T)."""
    return None if window >= T - 1 else window_mask(torch.arange(T, device=device), T, window)


def fp32_scores(q, k_t):
    """q @ k_t (..., T, D) @ (..., D, Tk) with at least float32 results whatever the inputs' dtype, as a fused attention
    kernel keeps its scores: rounding them to bf16 would widen the sampler-trainer gap for nothing. On CUDA the
    matmul writes fp32 itself (bmm's out_dtype); elsewhere the inputs are upcast (exactly) first. Both are fp32
    accumulations of the same products. Autocast is off inside: on a CPU it would cast a matmul's fp32 inputs back
    to bf16 and return bf16 scores."""
    with without_autocast(q.device.type):
        return _fp32_product(q, k_t)


# where a bf16/fp16 matmul writes fp32 scores itself (bmm's out_dtype); nanochat/diagnostics/gpu_kernel_work.py adds
# "meta" while it records a step as CUDA runs it
FP32_BMM_DEVICES = ("cuda",)


def _fp32_product(q, k_t):
    if q.dtype in (torch.float32, torch.float64):  # already at least fp32
        return q @ k_t
    if q.device.type in FP32_BMM_DEVICES:
        batch = torch.broadcast_shapes(q.shape[:-2], k_t.shape[:-2])
        scores = torch.bmm(q.expand(*batch, *q.shape[-2:]).reshape(-1, *q.shape[-2:]),
                           k_t.expand(*batch, *k_t.shape[-2:]).reshape(-1, *k_t.shape[-2:]), out_dtype=torch.float32)
        return scores.view(*batch, q.size(-2), k_t.size(-1))
    return q.float() @ k_t.float()


class AttentionContext(Protocol):
    """What the model's attention layers call (the module docstring)."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        ...


class CacheStep(AttentionContext, Protocol):
    """One forward of T new tokens per row over a KV cache (the module docstring)."""
    positions: torch.Tensor                 # (B, T) int64: absolute position of each new token
    smear_previous: Optional[torch.Tensor]  # (B, 1, C): normed embedding of each row's last cached token, to
                                            # smear into its first new one; None: nothing to smear from

    def keep_smear_state(self, embedding: torch.Tensor) -> None:
        """embedding (B, 1, C): the normed embedding of each row's last new token, for the next step."""

    def advance(self) -> None:
        """After the forward: the cache holds the new tokens (rows in use move on by T)."""


def run_cached(model, idx, step):
    """The model's logits (B, T, V) for idx (B, T), the tokens `step` places after what each cache row holds;
    then the cache holds them too."""
    logits = model(idx, cache_step=step)
    step.advance()
    return logits


class Visibility:
    """A window's visibility, made by `make(window)` at the first layer that asks and kept for the others."""

    def __init__(self, make):
        self.make, self.made = make, {}

    def __call__(self, window):
        if window not in self.made:
            self.made[window] = self.make(window)
        return self.made[window]


class SequenceAttention:
    """A sequence of T tokens at positions 0..T-1, each attending to itself and the ones before it."""

    def __init__(self, T, device):
        self.mask = Visibility(lambda window: sequence_mask(T, window, device))

    def attend(self, layer_idx, q, k, v, window):
        return attend(q, k, v, self.mask(window))


class SharedPrefixAttention:
    """Training rows that continue prompts whose keys are recorded once. The prompts' forward (`recording`, one row
    a prompt) keeps every layer's keys/values, autograd history included; the rows' forward then attends, row by
    row, to its own prompt's keys followed by its own, so each prompt is computed once and its gradient gathers
    every row's contribution. One prompt of P tokens (row_prompt None): every row continues it. Several:
    prompt_lengths (Q,) the real tokens of each (right-padded to P: the padding is never visible), row_prompt (B,)
    the prompt each row continues; row b's query s, at position P_b + s, sees prompt keys j < P_b and its own keys
    up to s, under the layer's window (prompts_and_rows_mask)."""

    def __init__(self, P, S, device, prompt_lengths=None, row_prompt=None):
        self.k, self.v, self.recording, self.row_prompt = {}, {}, True, row_prompt
        self.prefix_mask = Visibility(lambda window: sequence_mask(P, window, device))  # causal: padding comes last
        if row_prompt is None:
            self.positions = P + torch.arange(S, device=device)  # (S,) the rows' tokens' positions
            self.rows_mask = Visibility(lambda window: window_mask(self.positions, P + S, window))  # (S, P + S)
        else:
            self.row_lengths = prompt_lengths[row_prompt]  # (B,) each row's prompt's
            self.positions = self.row_lengths[:, None] + torch.arange(S, device=device)  # (B, S)
            self.rows_mask = Visibility(lambda window: prompts_and_rows_mask(self.row_lengths, P, S, window))

    def last_prompt_tokens(self, prompts):
        """prompts (Q, P) -> (1, 1) the prompt's last token, or (B, 1) each row's prompt's (smear mixes it in)."""
        return prompts[:, -1:] if self.row_prompt is None else prompts[self.row_prompt, self.row_lengths - 1][:, None]

    def attend(self, layer_idx, q, k, v, window):
        if self.recording:
            self.k[layer_idx], self.v[layer_idx] = k, v
            return attend(q, k, v, self.prefix_mask(window))
        B = k.size(0)
        if self.row_prompt is None:
            prompt_k, prompt_v = self.k[layer_idx].expand(B, -1, -1, -1), self.v[layer_idx].expand(B, -1, -1, -1)
        else:  # (B, P, Hkv, D): each row's own prompt's
            prompt_k, prompt_v = self.k[layer_idx][self.row_prompt], self.v[layer_idx][self.row_prompt]
        k, v = torch.cat([prompt_k, k], dim=1), torch.cat([prompt_v, v], dim=1)
        return attend(q, k, v, self.rows_mask(window))


def prompts_and_rows_mask(row_lengths, P, S, window):
    """The visibility of SharedPrefixAttention's rows over several prompts: bool (B, 1, S, P + S), the keys being
    each row's prompt (P slots, the first row_lengths[b] real) followed by its S own. row_lengths: (B,) int64."""
    B, device = row_lengths.size(0), row_lengths.device
    row_lengths = row_lengths.to(torch.int32)  # positions < 2**31: the (B, S, P + S) differences below at half the bytes
    query = row_lengths[:, None] + torch.arange(S, device=device, dtype=torch.int32)  # (B, S) absolute positions
    prompt_slots = torch.arange(P, device=device, dtype=torch.int32).expand(B, P)
    keys = torch.cat([prompt_slots, query], dim=1)  # (B, P + S) absolute positions
    real = torch.cat([prompt_slots < row_lengths[:, None], torch.ones(B, S, dtype=torch.bool, device=device)], dim=1)
    delta = query[:, :, None] - keys[:, None, :]  # (B, S, P + S)
    return (real[:, None, :] & (delta >= 0) & (delta <= window))[:, None]
