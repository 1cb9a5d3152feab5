"""nanochat/kernels/' Triton kernels compiled for an H100/H200 (sm_90) on this machine, GPU or not, as the engine's
d20 calls bind them (nanochat/diagnostics/kernel_binary.py): what Triton's interpreter (tests/kernels/
test_triton_kernels.py) cannot check."""

import os

import pytest

pytest.importorskip("triton", reason="the kernels' tests need triton (tests/run.sh installs it)")
from nanochat.diagnostics.kernel_binary import VARIANTS, kernel_binaries  # noqa: E402

STEP_KERNELS = {"_residual_norm_kernel", "_rotary_store_kernel", "_own_keys_kernel", "_prompt_attention_kernel",
                "_relu_square_kernel", "_sample_kernel"}
# the GPU image's triton (pinned by its torch), installed apart: pip install --target DIR --no-deps triton==3.6.0
TRITON_36 = os.environ.get("NANOCHAT_TRITON36_DIR")


@pytest.mark.slow
@pytest.mark.parametrize("triton_dir", [None, pytest.param(TRITON_36, id="triton-3.6.0", marks=pytest.mark.skipif(
    not (TRITON_36 and os.path.isdir(os.path.join(TRITON_36, "triton"))), reason="no NANOCHAT_TRITON36_DIR install"))])
def test_every_recorded_kernel_compiles_for_an_sm90_gpu_without_spilling(triton_dir):
    """Every kernel launch of a d20 decode step, bf16 and fp32 rollouts, bound as Triton binds the engine's real
    calls (pointer dtypes, divisibility by 16, ints equal to 1, constexprs, num_warps), and the branches d20 does not
    take (VARIANTS), compile for sm_90 and assemble with Triton's ptxas without register spills."""
    binaries = kernel_binaries(triton_dir)
    if triton_dir is not None:
        assert {b["triton"] for b in binaries} == {"3.6.0"}
    assert {b["kernel"] for b in binaries if b["variant"] == "d20 bf16"} == STEP_KERNELS
    # each binding once: the sampler takes fp32 logits in both rollouts, so fp32's binds as bf16's did
    assert {b["kernel"] for b in binaries if b["variant"] == "d20 fp32"} == STEP_KERNELS - {"_sample_kernel"}
    assert {b["variant"].rsplit(" ", 1)[0] for b in binaries} == {v.name for v in VARIANTS}  # each adds a binding
    assert [(b["kernel"], b["variant"], b["spill_bytes"]) for b in binaries if b["spill_bytes"]] == []
    # the dtype mix the real calls have: bf16 projections and caches beside fp32 rotary tables and residual stream
    assert {b["pointers"] for b in binaries if b["variant"] == "d20 bf16" and b["kernel"] == "_rotary_store_kernel"} \
        == {"bf16 fp32"}
    # the attention's two kernels as d20 launches them: the own keys one program per (row, kv head, split of 128 keys:
    # 2 at 256 keys), 4 warps, writing fp32 parts; the prompts and the merge one per (slot, kv head) and the free-row
    # programs, 4 warps for 16 rows (prompt_attention.attention_warps)
    own = [b for b in binaries if b["kernel"] == "_own_keys_kernel" and b["variant"] == "d20 bf16"]
    assert [(b["pointers"], b["num_warps"], b["grid"]) for b in own] == [("bf16 fp32", 4, 256 * 10 * 2)]
    attention = [b for b in binaries if b["kernel"] == "_prompt_attention_kernel" and b["variant"] == "d20 bf16"]
    assert [(b["pointers"], b["num_warps"], b["grid"]) for b in attention] == [("bf16 fp32", 4, 16 * 10 + 256 // 16)]
