"""
The vocabulary-wide head: logits from the final hidden states, and for training the log-probability and entropy
of the sampled tokens, computed a chunk of tokens at a time so that no float32 (N, V) tensor outlives one chunk of
HEAD_CHUNK_TOKENS tokens (forward and backward alike; up to one chunk, the plain computation).

    z       = (hidden @ W^T)[:, :vocab_size], float32     (W: the head's rows, padded to a multiple of 64)
    logits  = softcap * tanh(z / softcap)
    logp_t  = log_softmax(logits)[target_t]
    H_t     = -sum_v p_v log p_v                           (a diagnostic: no gradient)

Backward, chunk by chunk from the saved hidden states and W alone: each chunk's logits are computed again and
differentiated by autograd, under the forward's autocast, so the gradient is the unchunked computation's, the same
kernels on the same values (bit for bit within one chunk), up to the summation of W's gradient over chunks.
"""

import contextlib

import torch
import torch.nn.functional as F

from nanochat.model.precision import autocast_enabled

# tokens per chunk: at a 65,536-token vocabulary each float32 (chunk, V) temporary is 512 MiB
HEAD_CHUNK_TOKENS = 2048


def softcapped_logits(hidden, weight, vocab_size, softcap):
    """(..., C) hidden states, W (V_padded, C) -> float32 logits (..., vocab_size), softcap * tanh(z / softcap)."""
    logits = F.linear(hidden, weight)[..., :vocab_size].float()
    return softcap * torch.tanh(logits / softcap)


def logprobs_and_entropy(logits, targets):
    """From one forward's logits, the log-probability of each target and the policy's entropy.

    logits: (..., V) float; targets: (...) with -1 for positions without a target.
    Returns logp (...) (0 where target == -1) and the mean entropy over valid positions (a detached
    scalar; the entropy is a diagnostic only, so it needs no second forward and no gradient).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    valid = targets >= 0
    logp = _of_targets(logprobs, targets.clamp(min=0)) * valid
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)  # (B, T)
        mean_entropy = (entropy * valid).sum() / valid.sum().clamp(min=1)
    return logp, mean_entropy


def sampled_logprobs_and_entropy(hidden, weight, targets, vocab_size, softcap, chunk_tokens=None):
    """logprobs_and_entropy(softcapped_logits(hidden, weight, vocab_size, softcap), targets), the same values and
    gradients (wrt hidden and weight), computed chunk_tokens (default HEAD_CHUNK_TOKENS) tokens at a time (the
    module docstring).
    hidden: (..., C); targets: (...), -1 where there is none. At most one chunk of tokens, the plain form: it keeps
    one chunk's logits for the backward, which computing them again would not save (and would cost a matmul).
    Compiled (torch.compile), the plain form too: Inductor fuses it, and a Python loop over a dynamic number of
    tokens would be a guard on it."""
    chunk_tokens = chunk_tokens or HEAD_CHUNK_TOKENS
    if torch.compiler.is_compiling() or targets.numel() <= chunk_tokens:
        return logprobs_and_entropy(softcapped_logits(hidden, weight, vocab_size, softcap), targets)
    valid = targets >= 0
    logp, entropy = _ChunkedHead.apply(hidden.reshape(-1, hidden.size(-1)), weight, targets.clamp(min=0).reshape(-1),
                                       vocab_size, softcap, chunk_tokens)
    logp, entropy = logp.view(targets.shape) * valid, entropy.view(targets.shape)
    return logp, (entropy * valid).sum() / valid.sum().clamp(min=1)


def _autocast_state(device_type):
    """(device_type, dtype) of the autocast in force, or None (none, or a device without autocast: meta)."""
    if autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def _chunk_logprobs(hidden, weight, vocab_size, softcap):
    """(n, C) hidden states -> (n, V) float32 log-probabilities of the softcapped logits."""
    return torch.log_softmax(softcapped_logits(hidden, weight, vocab_size, softcap), dim=-1)


def _of_targets(logprobs, targets):
    """(..., V) log-probabilities, (...) targets >= 0 -> (...) each target's."""
    return logprobs.gather(-1, targets[..., None]).squeeze(-1)


class _ChunkedHead(torch.autograd.Function):
    """(hidden (N, C), W, targets (N,) >= 0) -> (logp (N,), entropy (N,), no gradient); saves hidden, W and targets
    (the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_size, softcap, chunk_tokens):
        logp, entropy = [], []
        for lo in range(0, max(hidden.size(0), 1), chunk_tokens):
            logprobs = _chunk_logprobs(hidden[lo:lo + chunk_tokens], weight, vocab_size, softcap)  # (n, V) float32
            logp.append(_of_targets(logprobs, targets[lo:lo + chunk_tokens]))
            entropy.append(-(logprobs.exp() * logprobs).sum(-1))
        ctx.save_for_backward(hidden, weight, targets)
        ctx.vocab_size, ctx.softcap, ctx.chunk_tokens = vocab_size, softcap, chunk_tokens
        ctx.autocast = _autocast_state(hidden.device.type)
        entropy = torch.cat(entropy)
        ctx.mark_non_differentiable(entropy)
        return torch.cat(logp), entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        n = ctx.chunk_tokens
        grad_hidden, grad_weight = [], None
        weight = weight.detach().requires_grad_()
        with torch.enable_grad(), torch.autocast(*ctx.autocast) if ctx.autocast else contextlib.nullcontext():
            for lo in range(0, max(hidden.size(0), 1), n):
                h = hidden[lo:lo + n].detach().requires_grad_()
                logp = _of_targets(_chunk_logprobs(h, weight, ctx.vocab_size, ctx.softcap), targets[lo:lo + n])  # again
                grad_h, grad_w = torch.autograd.grad(logp, (h, weight), grad_logp[lo:lo + n])
                grad_hidden.append(grad_h)
                grad_weight = grad_w if grad_weight is None else grad_weight.add_(grad_w)  # (V_padded, C)
        return torch.cat(grad_hidden), grad_weight, None, None, None, None
