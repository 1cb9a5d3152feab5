"""nanochat/attention.py's kernels: the explicit attention a CPU runs in bf16 against PyTorch's fused one, and
fp32_scores under autocast."""

import pytest
import torch
import torch.nn.functional as F

from nanochat.attention import attend, explicit_attention, fp32_scores, window_mask

BF16_UNIT = 2.0 ** -8  # bf16's unit roundoff (8 significand bits): one rounding moves a value by at most this, relative


def random_qkv(B, T, Tk, H, Hkv, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return make(B, T, H, D), make(B, Tk, Hkv, D), make(B, Tk, Hkv, D)


def masks(T, Tk):
    """The masks training passes: None (causal, T == Tk), a sliding window over a sequence, and a shared prompt's
    rows (queries at positions Tk - T.., the prompt's keys first) under a window."""
    positions = (Tk - T) + torch.arange(T)
    out = {"rows of a shared prompt": window_mask(positions, Tk, window=Tk // 2)}
    if T == Tk:
        out.update({"causal": None, "sliding window": window_mask(torch.arange(T), T, window=3)})
    return out


def fused_reference(q, k, v, mask):
    """PyTorch's own attention in float64 (its math kernel): the reference both kernels are held to."""
    q, k, v = (x.double() for x in (q, k, v))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          is_causal=mask is None, enable_gqa=k.size(2) != q.size(2))


@pytest.mark.parametrize("T,Tk", [(7, 7), (5, 12)])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_explicit_attention_computes_what_the_fused_kernel_does(T, Tk, Hkv):
    """In float64 the written-out attention and PyTorch's agree to float64 rounding, output and gradients, for
    every mask training uses and with grouped-query heads."""
    for name, mask in masks(T, Tk).items():
        inputs = [x.requires_grad_() for x in random_qkv(3, T, Tk, 4, Hkv, 16, torch.float64)]
        ours = explicit_attention(*inputs, mask)
        grads = torch.autograd.grad(ours.square().sum(), inputs)
        ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
        ref = fused_reference(*ref_inputs, mask)
        ref_grads = torch.autograd.grad(ref.square().sum(), ref_inputs)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, msg=name)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_attention_on_a_cpu_is_the_explicit_one_within_bf16_rounding(autocast):
    """attend() of several queries a row in bf16 on a CPU runs explicit_attention (bit for bit), with or without bf16
    autocast around it (training runs under it), and its result is within bf16's rounding of the exact attention of the same bf16
    inputs: the probabilities are rounded once to bf16 before the weighted sum and the output once after (fp32
    accumulation in between), so |y - y_exact| <= 2u (|y_exact| + sum_j p_j |v_j|) + fp32 terms, u = 2^-8."""
    T, Tk = 6, 11
    for name, mask in masks(T, Tk).items():
        q, k, v = random_qkv(2, T, Tk, 4, 2, 32, torch.bfloat16, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got = attend(q, k, v, mask)
            explicit = explicit_attention(q, k, v, mask)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, explicit), name
        exact = fused_reference(q, k, v, mask)  # (B, H, T, D)
        scores = torch.einsum("bthd,bshd->bhts", q.double(), k.double().repeat_interleave(2, dim=2)) / 32 ** 0.5
        visible = torch.ones(T, Tk, dtype=torch.bool) if mask is None else mask
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        magnitude = probs @ v.double().abs().repeat_interleave(2, dim=2).transpose(1, 2)
        bound = 2 * BF16_UNIT * (exact.abs() + magnitude) + 1e-6
        assert ((got.double() - exact).abs() <= bound).all(), name


def test_a_decode_steps_single_query_in_bf16_goes_to_the_fused_kernel():
    """One query a row (a decode step) keeps PyTorch's fused kernel in bf16 on a CPU (2.5x faster there than the
    explicit one at 256 rows): attend() gives exactly what it gives."""
    q, k, v = random_qkv(5, 1, 9, 4, 2, 32, torch.bfloat16, seed=3)
    visible = torch.rand(5, 1, 1, 9, generator=torch.Generator().manual_seed(4)) < 0.7
    visible[..., 0] = True
    fused = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible,
                                           enable_gqa=True)
    assert torch.equal(attend(q, k, v, visible), fused)


def test_fp32_scores_are_fp32_under_a_cpus_bf16_autocast():
    """Under CPU bf16 autocast a plain matmul of upcast inputs comes back in bf16 (autocast casts them down again);
    fp32_scores must not: exactly the fp32 product of the bf16 inputs."""
    q, k, _ = random_qkv(2, 3, 5, 4, 4, 8, torch.bfloat16, seed=2)
    q, k_t = q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = fp32_scores(q, k_t)
        assert (q.float() @ k_t.float()).dtype == torch.bfloat16  # what autocast does to the plain product
    assert scores.dtype == torch.float32
    assert torch.equal(scores, q.float() @ k_t.float())
