"""
The decode step's sampler in one kernel after top-k: nanochat.model.sampling.sample_with_logprobs (Gumbel-max over
each row's own counter-based random stream) writing the batch's `sampled` (token, log-probability under the model,
under the sampled distribution) and advancing the streams of the rows in use, one program per row.

    lse      = logsumexp(logits)                      over the whole vocabulary (the model's log-probability)
    temperature 0: token = argmax(logits) (its first maximum), sampled log-probability 0
    else:    candidates = the top-k (values, indices), or every logit; scaled = values / T (T = 1: values)
             token = candidate argmax(scaled - log(-log(u))), u the row's uniforms (sampling.row_uniforms)
             sampled log-probability = scaled[token] - logsumexp(scaled)

The hash, the uniforms and the noise are sampling.py's, op for op; only the sums' order differs (logsumexp).
"""

import torch

from nanochat.kernels.launch import kernel, tl

BLOCK_VOCAB = 1024


@kernel
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


@kernel
def _sample_kernel(logits_ptr, values_ptr, indices_ptr, seeds_ptr, draws_ptr, active_ptr, sampled_ptr, V, C,
                   temperature, logits_sb, values_sb, indices_sb,
                   BLOCK: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr):
    row = tl.program_id(0)
    # 64-bit: rows x V logits pass 2^31 at sizes a user may set (32768 rows of a 65536 vocabulary)
    logits_row = logits_ptr + row.to(tl.int64) * logits_sb
    log_normalizer, best, best_index = _normalizer_and_argmax(logits_row, V, BLOCK, GREEDY)
    step = tl.load(draws_ptr + row)
    if GREEDY:
        token = best_index
        model_lp = best - log_normalizer
        sampling_lp = 0.0
    else:
        seed = tl.load(seeds_ptr + row)
        base = _mix32((_mix32(seed & 0xFFFFFFFF) ^ step) & 0xFFFFFFFF)
        values_row = values_ptr + row * values_sb if TOP_K else logits_row
        choice, scaled_normalizer = _gumbel_choice(values_row, C, base, temperature, BLOCK, SCALE)
        chosen = tl.load(values_row + choice)
        token = tl.load(indices_ptr + row * indices_sb + choice) if TOP_K else choice
        chosen_scaled = chosen / temperature if SCALE else chosen
        model_lp = chosen - log_normalizer
        sampling_lp = chosen_scaled - scaled_normalizer
    tl.store(sampled_ptr + row * 3, token.to(tl.float32))
    tl.store(sampled_ptr + row * 3 + 1, model_lp)
    tl.store(sampled_ptr + row * 3 + 2, sampling_lp)
    tl.store(draws_ptr + row, step + tl.load(active_ptr + row))


@kernel
def _normalizer_and_argmax(x_ptr, V, BLOCK: tl.constexpr, ARGMAX: tl.constexpr):
    """(logsumexp of x[0..V-1], with ARGMAX its maximum and that maximum's first index) in one pass of blocks."""
    lanes = tl.arange(0, BLOCK)
    top = float("-inf")
    total = 0.0
    best = float("-inf")
    best_index = 0
    for start in range(0, V, BLOCK):
        i = start + lanes
        x = tl.load(x_ptr + i, mask=i < V, other=float("-inf"))
        top, total = _running_logsumexp(x, top, total)
        if ARGMAX:
            best, best_index = _running_argmax(x, start, best, best_index)
    return top + tl.log(total), best, best_index


@kernel
def _gumbel_choice(values_ptr, C, base, temperature, BLOCK: tl.constexpr, SCALE: tl.constexpr):
    """(the candidate c in 0..C-1 maximizing scaled_c - log(-log(u_c)), logsumexp of the scaled values), u_c the row's
    uniform for candidate c (sampling.row_uniforms from `base`), scaled = values / temperature where SCALE."""
    lanes = tl.arange(0, BLOCK)
    top = float("-inf")
    total = 0.0
    best = float("-inf")
    best_index = 0
    for start in range(0, C, BLOCK):
        i = start + lanes
        ok = i < C
        values = tl.load(values_ptr + i, mask=ok, other=float("-inf"))
        if SCALE:
            values = values / temperature
        bits = _mix32(base ^ _mix32(i.to(tl.int64) + 0x632BE5AB))
        u = ((bits >> 8).to(tl.float32) + 0.5) / 16777216.0
        best, best_index = _running_argmax(tl.where(ok, values - tl.log(-tl.log(u)), float("-inf")), start, best,
                                           best_index)
        top, total = _running_logsumexp(values, top, total)
    return best_index, top + tl.log(total)


@kernel
def _running_logsumexp(x, top, total):
    """A block x into a running logsumexp kept as (maximum, sum of exp(x - maximum))."""
    new_top = tl.maximum(top, tl.max(x, axis=0))
    return new_top, total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)


@kernel
def _running_argmax(z, start, best, best_index):
    """A block z of the values from index `start` into a running (maximum, its first index): strictly greater only,
    so ties keep the earlier index, as torch.argmax."""
    block_best = tl.max(z, axis=0)
    block_index = start + tl.argmax(z, axis=0, tie_break_left=True)
    return tl.maximum(best, block_best), tl.where(block_best > best, block_index, best_index)


@torch.library.custom_op("nanochat::sample_rows", mutates_args=("sampled", "draws"))
def sample_rows(logits: torch.Tensor, top_values: torch.Tensor | None, top_indices: torch.Tensor | None,
                seeds: torch.Tensor, draws: torch.Tensor, active: torch.Tensor, sampled: torch.Tensor,
                temperature: float) -> None:
    """logits: (B, V) float32; top_values, top_indices: (B, k) torch.topk of them, or None (no top-k); seeds, draws,
    active: (B,) int64 each row's stream, tokens drawn, 1 if in use; sampled: (B, 3) float32, written (the module
    docstring); draws += active."""
    B, V = logits.shape
    top_k = top_values is not None
    values = top_values if top_k else logits
    indices = top_indices if top_k else logits
    C = values.size(1)
    _sample_kernel.on(logits.device)[(B,)](
        logits, values, indices, seeds, draws, active, sampled, V, C, temperature if temperature else 1.0,
        logits.stride(0), values.stride(0), indices.stride(0),
        BLOCK=BLOCK_VOCAB, GREEDY=temperature == 0.0, TOP_K=top_k, SCALE=temperature not in (0.0, 1.0))


@sample_rows.register_fake
def _(logits, top_values, top_indices, seeds, draws, active, sampled, temperature):
    return None
