"""nanochat/model/attention.py's kernels: the explicit attention a CPU runs in bf16 against PyTorch's fused one, and
fp32_scores under autocast."""

import pytest
import torch
import torch.nn.functional as F

from nanochat.model.attention import EXPLICIT_MAX_KEYS, attend, explicit_attention, fp32_scores, window_mask

BF16_UNIT = 2.0 ** -8  # bf16's unit roundoff (8 significand bits): one rounding moves a value by at most this, relative


def random_qkv(B, T, Tk, H, Hkv, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return make(B, T, H, D), make(B, Tk, Hkv, D), make(B, Tk, Hkv, D)


def masks(T, Tk, B=3):
    """The masks attention is given: None (causal, T == Tk), a sliding window over a sequence, a shared prompt's
    rows (queries at positions Tk - T.., the prompt's keys first) under a window, and per-row masks (B, 1, T, Tk)
    (a cache step of several tokens: rows whose keys start at different positions)."""
    positions = (Tk - T) + torch.arange(T)
    starts = torch.arange(B) % max(1, Tk - T + 1)  # row b's keys before start b are not its own
    per_row = window_mask(positions, Tk, window=Tk) & (torch.arange(Tk) >= starts[:, None, None])
    out = {"rows of a shared prompt": window_mask(positions, Tk, window=Tk // 3), "per row": per_row[:, None]}
    if T == Tk:
        out.update({"causal": None, "sliding window": window_mask(torch.arange(T), T, window=2)})
    return out


def visible_keys(mask, T, Tk):
    """The bool mask a None (causal) stands for."""
    return torch.ones(T, Tk, dtype=torch.bool).tril() if mask is None else mask


def sdpa_reference(q, k, v, mask):
    """What PyTorch's scaled_dot_product_attention computes, in float64: the reference both kernels are held to."""
    q, k, v = (x.double() for x in (q, k, v))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          is_causal=mask is None, enable_gqa=k.size(2) != q.size(2))


@pytest.mark.parametrize("T,Tk", [(7, 7), (5, 12)])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_explicit_attention_computes_what_pytorchs_attention_does(T, Tk, Hkv):
    """In float64 the written-out attention and PyTorch's agree to float64 rounding, output and gradients, for
    every mask training uses and with grouped-query heads."""
    for name, mask in masks(T, Tk).items():
        inputs = [x.requires_grad_() for x in random_qkv(3, T, Tk, 4, Hkv, 16, torch.float64)]
        ours = explicit_attention(*inputs, mask)
        grads = torch.autograd.grad(ours.square().sum(), inputs)
        ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
        ref = sdpa_reference(*ref_inputs, mask)
        ref_grads = torch.autograd.grad(ref.square().sum(), ref_inputs)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, msg=name)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("T,Tk", [(7, 7), (6, 11)])
@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_attention_on_a_cpu_is_the_explicit_one_within_bf16_rounding(T, Tk, autocast):
    """attend() of several queries a row in bf16 on a CPU runs explicit_attention (bit for bit), with or without bf16
    autocast around it (training runs under it), and its result is within bf16's rounding of the exact attention of
    the same bf16 inputs: the probabilities are rounded once to bf16 before the weighted sum and the output once
    after (fp32 accumulation in between), so |y - y_exact| <= 2u (|y_exact| + sum_j p_j |v_j|) + fp32 terms,
    u = 2^-8."""
    H, Hkv, D = 4, 2, 32
    for name, mask in masks(T, Tk, B=2).items():
        q, k, v = random_qkv(2, T, Tk, H, Hkv, D, torch.bfloat16, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = attend(q, k, v, mask)
            explicit = explicit_attention(q, k, v, mask)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, explicit), name
        exact = sdpa_reference(q, k, v, mask)  # (B, H, T, D)
        k64, v64 = (x.double().repeat_interleave(H // Hkv, dim=2).transpose(1, 2) for x in (k, v))  # (B, H, Tk, D)
        scores = q.double().transpose(1, 2) @ k64.transpose(-1, -2) / D ** 0.5
        probs = scores.masked_fill(~visible_keys(mask, T, Tk), float("-inf")).softmax(-1)
        bound = 2 * BF16_UNIT * (exact.abs() + probs @ v64.abs()) + 1e-6
        assert ((got.double() - exact).abs() <= bound).all(), name


@pytest.mark.parametrize("T,Tk", [(1, 9), (3, EXPLICIT_MAX_KEYS + 1)])
def test_one_query_or_many_keys_in_bf16_go_to_the_fused_kernel(T, Tk):
    """One query a row (a decode step; the fused kernel 2.5x faster there at 256 rows) and more than
    EXPLICIT_MAX_KEYS keys (long sequences, where the explicit (T, keys) scores lose) keep PyTorch's fused kernel in
    bf16 on a CPU: attend() gives exactly what it gives."""
    q, k, v = random_qkv(5, T, Tk, 4, 2, 32, torch.bfloat16, seed=3)
    visible = torch.rand(5, 1, T, Tk, generator=torch.Generator().manual_seed(4)) < 0.7
    visible[..., 0] = True
    fused = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible,
                                           enable_gqa=True)
    assert torch.equal(attend(q, k, v, visible), fused)


def test_fp32_scores_are_fp32_under_a_cpus_bf16_autocast():
    """Under CPU bf16 autocast a plain matmul of upcast inputs comes back in bf16 (autocast casts them down again);
    fp32_scores must not: exactly the fp32 product of the inputs, bf16 or fp32 ones. On the meta device (op counts),
    which has no autocast, it still runs."""
    for dtype in (torch.bfloat16, torch.float32):
        q, k, _ = random_qkv(2, 3, 5, 4, 4, 8, dtype, seed=2)
        q, k_t = q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = fp32_scores(q, k_t)
            assert (q.float() @ k_t.float()).dtype == torch.bfloat16  # what autocast does to the plain product
        assert scores.dtype == torch.float32
        assert torch.equal(scores, q.float() @ k_t.float())
        assert fp32_scores(q.to("meta"), k_t.to("meta")).dtype == torch.float32
