"""
FLOP counts of training and rollouts, for MFU. Training: 6 per matmul weight; attention 12 * n_head * head_dim *
keys per layer with every query seeing all T keys of its row (the PaLM convention), with the real row length T
(GPT.estimate_flops is this at sequence_len). Rollouts count forward FLOPs (a third of that) with the keys each
query really sees.
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


def lookup_params(model):
    """A GPT's parameters that are read by lookup or as scalars, not multiplied as matrices."""
    params = [model.transformer.wte.weight]
    if model.generation.value_embeds:
        params += [e.weight for e in model.value_embeds.values()]
    params += [getattr(model, name) for name in ("resid_lambdas", "x0_lambdas", "smear_lambda", "backout_lambda")
               if hasattr(model, name)]
    if model.generation.smear:
        params.append(model.smear_gate.weight)  # a 24-wide gate: nanochat counts it with the scalars
    return params


def matmul_flops_per_token(model):
    """6 x the weights used in matmuls (2 forward, 4 backward): every weight but the lookup_params; lm_head counts
    with its padded rows."""
    return 6 * (model.num_params() - sum(p.numel() for p in lookup_params(model)))


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
    decode = sum((s - 1) * per_token
                 + unit * sum(_sum_min(w, prompt_len + 1, prompt_len + s - 1) for w in model.window_sizes)
                 for s in row_steps)
    return num_prefills * prefill + decode
