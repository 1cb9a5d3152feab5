"""tests/support/bounds_harness.py and launched_numerics.py, the interpreter's checks and fixes the kernels' tests run
under: an access outside its argument's extent fails naming the kernel, the argument, the offset and the extent (a
view's own extent, not its storage's; masked lanes free to point anywhere); stores are counted per element; and what
Triton's interpreter does with bf16 and tl.dot, without and with launched_numerics."""

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels' tests need triton (tests/run.sh installs it)")
from bounds_harness import OutOfBounds, checked_memory  # noqa: E402
from kernel_targets import INTERPRETER_SKIP  # noqa: E402
from launched_numerics import launched_numerics  # noqa: E402
from triton.runtime.errors import InterpreterError  # noqa: E402

from nanochat.kernels.launch import kernel, tl  # noqa: E402

pytestmark = INTERPRETER_SKIP


@kernel
def _copy_kernel(src_ptr, dst_ptr, n, shift, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i + shift, mask=i < n, other=0.0), mask=i < n)


def copy(src, dst, n, shift=0, block=8):
    _copy_kernel.on(src.device)[(-(-n // block),)](src, dst, n, shift, BLOCK=block)


def test_an_access_past_its_tensor_fails_naming_kernel_argument_offset_and_extent():
    src, dst = torch.arange(20.0), torch.zeros(20)
    with checked_memory() as memory:
        copy(src, dst, 20)  # 3 programs of 8, the last one's lanes 20-23 masked off
        assert torch.equal(dst, src) and memory.launch("_copy_kernel").accesses == 40
        with pytest.raises(InterpreterError) as failure:
            copy(src, dst, 20, shift=1)  # reads src[20]
    assert isinstance(failure.value.__cause__, OutOfBounds)
    assert ("_copy_kernel (program (2, 0, 0)): a load of argument src_ptr at element offset 20 outside its extent "
            "(elements [0, 20) of 4-byte items); 1 such lane(s)") in str(failure.value)


def test_a_views_extent_is_its_own_span_not_its_storages():
    """A layer of a cache (a view) read one element past its end fails, though the storage holds the next layer."""
    cache, dst = torch.arange(40.0).view(2, 20), torch.zeros(20)
    with checked_memory():
        copy(cache[0], dst, 20)
        assert torch.equal(dst, cache[0])
        with pytest.raises(InterpreterError, match="argument src_ptr at element offset 20 outside its extent"):
            copy(cache[0], dst, 20, shift=1)
        with pytest.raises(InterpreterError, match="argument src_ptr at element offset -1 outside its extent"):
            copy(cache[1], dst, 20, shift=-1)


def test_stores_are_counted_per_element():
    src, dst = torch.arange(20.0), torch.zeros(24)
    with checked_memory() as memory:
        copy(src, dst, 20)
    counts = memory.launch("_copy_kernel").write_counts("dst_ptr")
    assert counts.tolist() == [1] * 20 + [0] * 4


@kernel
def _dot_kernel(a_ptr, b_ptr, out_ptr, rounded_ptr, IEEE: tl.constexpr):
    i = tl.arange(0, 16)
    tile = i[:, None] * 16 + i[None, :]
    a, b = tl.load(a_ptr + tile), tl.load(b_ptr + tile)
    product = tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)
    tl.store(out_ptr + tile, product)
    tl.store(rounded_ptr + tile, product.to(tl.bfloat16))


def dot(a, b, ieee=True):
    out, rounded = torch.zeros(16, 16), torch.zeros(16, 16, dtype=torch.bfloat16)
    _dot_kernel.on(a.device)[(1,)](a, b, out, rounded, IEEE=ieee)
    return out, rounded


def test_the_interpreters_bf16_dot_multiplies_bits_and_launched_numerics_the_values():
    """Triton 3.9's interpreter: a bf16 tl.dot of ones gives 16 x 0x3F80^2 (1.0's bits as an integer, squared,
    summed over 16), and fp32 -> bf16 truncates (1 + 3 * 2^-9 becomes 1, not 1 + 2^-7); under launched_numerics
    the dot is exact and the rounding to nearest even, as a GPU computes them. If the first assertion fails, Triton
    fixed its interpreter: launched_numerics' dot and the op's fp32 copies can go."""
    ones = torch.ones(16, 16, dtype=torch.bfloat16)
    assert dot(ones, ones)[0][0, 0].item() == 16 * 0x3F80 ** 2
    near = torch.full((16, 16), (1 + 3 * 2 ** -9) / 16)  # each entry of the product: 1 + 3 * 2^-9
    eye = torch.eye(16) * 16
    assert dot(near, eye)[1][0, 0].item() == 1.0
    with launched_numerics():
        assert dot(ones, ones)[0][0, 0].item() == 16.0
        a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
        out, rounded = dot(a, b)
        torch.testing.assert_close(out, a.float() @ b.float(), rtol=0, atol=1e-5)
        assert torch.equal(rounded, out.bfloat16())
        assert dot(near, eye)[1][0, 0].item() == 1 + 2 ** -7


def test_launched_numerics_round_fp32_dot_operands_to_tf32_unless_ieee():
    """A GPU's tl.dot at its default precision takes fp32 operands as tf32 (10 mantissa bits): a kernel that forgets
    input_precision="ieee" loses fp32's precision there, and under launched_numerics here; with "ieee" it keeps it."""
    a = torch.full((16, 16), 1 + 2 ** -20)
    b = torch.eye(16)
    with launched_numerics():
        assert dot(a, b, ieee=True)[0][0, 0].item() == 1 + 2 ** -20
        assert dot(a, b, ieee=False)[0][0, 0].item() == 1.0
    assert np.float32(dot(a, b, ieee=False)[0][0, 0].item()) == np.float32(1 + 2 ** -20)  # the plain interpreter


@kernel
def _argmax_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, BLOCK))
    tl.store(out_ptr, tl.argmax(x, axis=0, tie_break_left=True))
    tl.store(out_ptr + 1, tl.argmax(x, axis=0, tie_break_left=False))


def test_launched_numerics_break_fast_ties_unlike_the_first():
    """tl.argmax without tie_break_left may take any of equal maxima on a GPU; the interpreter takes the first, and
    under launched_numerics the last: a kernel that needs the first must ask for it (tie_break_left=True)."""
    x, out = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0, 2.0, 0.0, 0.0]), torch.zeros(2, dtype=torch.int32)
    _argmax_kernel.on(x.device)[(1,)](x, out, BLOCK=8)
    assert out.tolist() == [1, 1]
    with launched_numerics():
        _argmax_kernel.on(x.device)[(1,)](x, out, BLOCK=8)
    assert out.tolist() == [1, 4]
