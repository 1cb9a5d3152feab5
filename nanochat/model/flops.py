"""
FLOP counts of training and rollouts, for MFU. Training follows GPT.estimate_flops (6 per matmul weight;
attention 12 * n_head * head_dim * keys per layer with every query seeing all T keys of its row, the PaLM
convention) but with the real row length T instead of sequence_len. Rollouts count forward FLOPs (a third of
that) with the keys each query really sees.
"""


def _attention_unit(model):
    """Forward FLOPs of one query against one key in one layer: QK^T and the weighted sum of V, 2 each."""
    cfg = model.config
    return 4 * cfg.n_head * (cfg.n_embd // cfg.n_head)


def _sum_min(w, a, b):
    """sum_{k=a}^{b} min(w, k) for integers 1 <= a, a - 1 <= b."""
    if b < a:
        return 0
    below = min(b, w)
    total = (a + below) * (below - a + 1) // 2 if below >= a else 0
    return total + w * (b - max(below, a - 1))


def matmul_flops_per_token(model):
    """6 x the weights used in matmuls: GPT.estimate_flops without its attention term."""
    return model.estimate_flops() - 3 * _attention_unit(model) * sum(min(w, model.config.sequence_len)
                                                                     for w in model.window_sizes)


def train_flops_per_token(model, T):
    """Forward + backward FLOPs per position of a T-long training row (estimate_flops at sequence_len T)."""
    return matmul_flops_per_token(model) + 3 * _attention_unit(model) * sum(min(w, T) for w in model.window_sizes)


def train_flops(model, batches):
    return sum(b.inputs.numel() * train_flops_per_token(model, b.inputs.size(1)) for b in batches)


def rollout_flops(model, prompt_len, num_prefills, row_steps):
    """Forward FLOPs of one question's rollouts: num_prefills prefills of the prompt (query i sees keys
    1..i), and per row, steps - 1 decode forwards (the first token comes from the prefill) whose queries
    see prompt_len + 1 .. prompt_len + steps - 1 keys."""
    per_token, unit = matmul_flops_per_token(model) // 3, _attention_unit(model)
    prefill = prompt_len * per_token + unit * sum(_sum_min(w, 1, prompt_len) for w in model.window_sizes)
    decode = sum((s - 1) * per_token + unit * sum(_sum_min(w, prompt_len + 1, prompt_len + s - 1) for w in model.window_sizes)
                 for s in row_steps)
    return num_prefills * prefill + decode
