"""
The tests' plain reference computations of what the library computes another way (oracles): nanochat's per-pass
policy-gradient objective (pass_objective, for nanochat/rl/objective.py) and the shared-prompt attention written with
torch ops row by row (reference_prompt_attention, for the Triton kernel of nanochat/kernels/prompt_attention.py).
"""

import math

import torch


def pass_objective(logp, targets, advantages, num_passes, examples_per_rank, num_valid=None):
    """nanochat's per-pass policy-gradient objective (to be maximised), as its chat_rl writes it: what the objective
    of nanochat/rl/objective.py is checked against.

    logp: (B, T) log-probabilities of the targets (any value where targets == -1; it is masked here).
    targets: (B, T) with -1 on positions that carry no gradient. advantages: (B,).
    Returns sum(logp * adv over valid positions) / (num_valid * num_passes * examples_per_rank), where
    num_valid defaults to the valid positions in these rows; pass the whole pass's count when the rows are
    a chunk of a pass (so chunking a pass to save memory leaves the objective unchanged).
    A pass with no valid target (every row empty) contributes 0.
    """
    valid = targets >= 0
    if num_valid is None:
        num_valid = valid.sum()
    num_valid = max(int(num_valid), 1)
    weighted = torch.where(valid, logp * advantages[:, None].to(logp.dtype), torch.zeros_like(logp))
    return weighted.sum() / (num_valid * num_passes * examples_per_rank)


def reference_prompt_attention(q, pool_k, pool_v, pool_len, cells, own_k, own_v, pos, sample, used_columns, keys,
                               window):
    """nanochat/kernels/prompt_attention.py's prompt_attention written with torch ops, row by row (slow, plain): the
    tests' second reference beside the hand-written step."""
    B, H, D = q.shape
    Hkv = pool_k.size(1)
    out = torch.zeros_like(q)
    slot_of = {int(r): s for s in range(cells.size(0)) for c in range(used_columns) if (r := int(cells[s, c])) >= 0}
    for b, slot in slot_of.items():
        L, p = int(pool_len[slot]), int(pos[b])
        k = torch.cat([pool_k[slot, :, :L], own_k[b, :, :keys]], dim=1).float()  # (Hkv, L + keys, D)
        v = torch.cat([pool_v[slot, :, :L], own_v[b, :, :keys]], dim=1).float()
        absolute = torch.cat([torch.arange(L), L + torch.arange(keys)])
        own = torch.cat([torch.zeros(L, dtype=torch.bool), torch.ones(keys, dtype=torch.bool)])
        query = L + p
        seen = (absolute <= query) & (query - absolute <= window) & (~own | (absolute - L <= p))
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        scores = (q[b].float()[:, None, :] @ k.transpose(1, 2))[:, 0] / math.sqrt(D)  # (H, keys)
        probs = scores.masked_fill(~seen.to(scores.device), float("-inf")).softmax(-1)
        out[b] = (probs[:, None, :] @ v)[:, 0].to(q.dtype)
    return out
