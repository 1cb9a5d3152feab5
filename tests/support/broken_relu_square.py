"""A deliberately broken kernel for tests/gpu/test_kernel_checks.py: relu_square's kernel with its relu dropped
(negative inputs squared too), put in place when a pytest run loads this module as a plugin (`-p broken_relu_square`,
with tests/support on PYTHONPATH and TRITON_INTERPRET=1 set before Python starts). The kernel checks must then fail,
naming relu_square."""

from nanochat.kernels import residual_norm
from nanochat.kernels.launch import kernel, tl


@kernel
def _relu_square_without_relu(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    u = tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (u * u).to(out_ptr.dtype.element_ty), mask=ok)


residual_norm._relu_square_kernel = _relu_square_without_relu
