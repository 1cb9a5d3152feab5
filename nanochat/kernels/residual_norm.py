"""
A block's residual bookkeeping and RMSNorm in one kernel (and the MLP's relu^2 in another), for the decode step.

    summed = x + delta                       (the previous sublayer's output added to the residual stream)
    x_new  = a * summed + sign * b * y        (the generations' per-layer lambdas: a = resid_lambdas[i], y = x0,
                                               b = x0_lambdas[i]; or backout: y = the kept residual, b = its lambda,
                                               sign -1)
    normed = rms_norm(x_new), rounded to `norm_dtype` (the dtype the next matmul takes)

each part optional. Every product and sum is rounded to fp32 as the model's separate ops round it (the residual
stream is fp32), so the values are those of the hand-written forward up to the norm's summation order.
"""

import torch

from nanochat.kernels.launch import block_size, kernel, tl
from nanochat.kernels.rotary_store import NORM_EPS


@kernel
def _residual_norm_kernel(x_ptr, delta_ptr, a_ptr, y_ptr, b_ptr, x_out_ptr, normed_ptr, summed_ptr, a_index,
                          b_index, sign, eps, B, C, x_sb, delta_sb, y_sb,
                          ROWS: tl.constexpr, BLOCK_C: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_A: tl.constexpr,
                          HAS_Y: tl.constexpr, KEEP_SUM: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # ROWS rows of C channels a program
    c = tl.arange(0, BLOCK_C)[None, :]
    ok = (row < B) & (c < C)
    x = tl.load(x_ptr + row * x_sb + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = x + tl.load(delta_ptr + row * delta_sb + c, mask=ok, other=0.0).to(tl.float32)
    if KEEP_SUM:
        tl.store(summed_ptr + row * C + c, x, mask=ok)
    if HAS_A:
        x = tl.load(a_ptr + a_index).to(tl.float32) * x
    if HAS_Y:
        b = tl.load(b_ptr + b_index).to(tl.float32)
        x = x + sign * (b * tl.load(y_ptr + row * y_sb + c, mask=ok, other=0.0).to(tl.float32))
    tl.store(x_out_ptr + row * C + c, x, mask=ok)
    mean_square = tl.sum(x * x, axis=1) / C  # (ROWS,)
    normed = x * (1.0 / tl.sqrt(mean_square + eps))[:, None]
    tl.store(normed_ptr + row * C + c, normed.to(normed_ptr.dtype.element_ty), mask=ok)


ROWS_PER_PROGRAM = 4


@torch.library.custom_op("nanochat::residual_norm", mutates_args=())
def residual_norm(x: torch.Tensor, delta: torch.Tensor | None, a: torch.Tensor | None, a_index: int,
                  y: torch.Tensor | None, b: torch.Tensor | None, b_index: int, sign: float, keep_sum: bool,
                  norm_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, delta, y: (B, C) (delta and y in any float dtype, x fp32); a, b: 1-d parameters read at a_index, b_index
    (the module docstring). Returns (x_new (B, C) fp32, normed (B, C) in norm_dtype, summed (B, C) fp32, or an
    empty tensor unless keep_sum)."""
    B, C = x.shape
    x_new = torch.empty(B, C, dtype=torch.float32, device=x.device)
    normed = torch.empty(B, C, dtype=norm_dtype, device=x.device)
    summed = torch.empty(B if keep_sum else 0, C, dtype=torch.float32, device=x.device)
    _residual_norm_kernel.on(x.device)[(-(-B // ROWS_PER_PROGRAM),)](
        x, delta if delta is not None else x, a if a is not None else x, y if y is not None else x,
        b if b is not None else x, x_new, normed, summed if keep_sum else x_new, a_index, b_index, sign, NORM_EPS, B, C,
        x.stride(0), delta.stride(0) if delta is not None else 0, y.stride(0) if y is not None else 0,
        ROWS=ROWS_PER_PROGRAM, BLOCK_C=block_size(C, floor=2), HAS_DELTA=delta is not None, HAS_A=a is not None, HAS_Y=y is not None,
        KEEP_SUM=keep_sum)
    return x_new, normed, summed


@residual_norm.register_fake
def _(x, delta, a, a_index, y, b, b_index, sign, keep_sum, norm_dtype):
    B, C = x.shape
    return (x.new_empty(B, C, dtype=torch.float32), x.new_empty(B, C, dtype=norm_dtype),
            x.new_empty(B if keep_sum else 0, C, dtype=torch.float32))


@kernel
def _relu_square_kernel(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    u = tl.maximum(tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + i, (u * u).to(out_ptr.dtype.element_ty), mask=ok)


RELU_SQUARE_BLOCK = 1024


@torch.library.custom_op("nanochat::relu_square", mutates_args=())
def relu_square(u: torch.Tensor) -> torch.Tensor:
    """relu(u)^2 (the MLP's activation) in u's dtype, one rounding, as F.relu(u).square() rounds."""
    u = u.contiguous()
    out = torch.empty_like(u)
    _relu_square_kernel.on(u.device)[(-(-u.numel() // RELU_SQUARE_BLOCK),)](u, out, u.numel(), BLOCK=RELU_SQUARE_BLOCK)
    return out


@relu_square.register_fake
def _(u):
    return torch.empty_like(u)
