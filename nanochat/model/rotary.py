"""
Rotary position embeddings: the tables of every generation (nanochat/model/generations.py says which rounds them to
bf16 and which base it uses), a forward's angles laid out once (Rotary), and the rotation of queries and keys.
"""

import torch


def rotary_tables(num_positions, head_dim, base=10000, bf16_rounded=True, device=None):
    """cos, sin: (num_positions, head_dim // 2) float32. Generations up to ve kept their tables in bf16 on
    every device, so with bf16_rounded the values are rounded to bf16: those checkpoints were trained with
    exactly these angles. Later ones keep them in the compute dtype (Rotary casts them to it)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=device), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    if bf16_rounded:
        cos, sin = cos.bfloat16().float(), sin.bfloat16().float()
    return cos, sin


def check_fits_rotary(length, rotary_len):
    """A ValueError when a sequence of `length` tokens has positions past the rotary tables' `rotary_len`."""
    if length > rotary_len:
        raise ValueError(f"sequence of {length} tokens is longer than the rotary tables ({rotary_len} positions)")


class Rotary:
    """The rotary angles of one forward's positions, laid out for apply_rotary: cos and sin (..., D) as [cos, cos]
    and [sin, -sin], from tables (..., D/2) broadcastable to (B, T, 1, D/2). They are cast to the dtype the first
    layer computes in once per forward, and every other layer reuses that copy (a cast in each layer was two
    kernels a layer). Casting commutes with concatenation and negation, so the values are those of the tables cast."""

    def __init__(self, cos, sin):
        self.tables = {cos.dtype: (torch.cat([cos, cos], dim=-1), torch.cat([sin, -sin], dim=-1))}
        self.source = self.tables[cos.dtype]

    def __call__(self, dtype):
        """(cos, sin) in `dtype`."""
        if dtype not in self.tables:
            self.tables[dtype] = tuple(t.to(dtype) for t in self.source)
        return self.tables[dtype]


def apply_rotary(x, rope):
    """x: (B, T, H, D); rope: a Rotary broadcastable to x. Rotates channel i with channel i + D/2, in x's precision:
    (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin), written as x * [cos, cos] + [x2, x1] * [sin, -sin] (the same
    products and sums, exactly: four kernels instead of seven)."""
    cos, sin = rope(x.dtype)
    d = x.size(-1) // 2
    return x * cos + torch.cat([x[..., d:], x[..., :d]], dim=-1) * sin
