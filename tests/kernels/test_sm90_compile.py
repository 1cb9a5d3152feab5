"""nanochat/kernels/' Triton kernels compiled for an H100/H200 (sm_90) on this machine, GPU or not: what Triton's
interpreter (tests/kernels/test_triton_kernels.py) cannot check."""

import os
import subprocess
import sys

import pytest
from helpers import PYTHONPATH, SUPPORT

pytest.importorskip("triton", reason="the kernels' tests need triton (tests/run.sh installs it)")


@pytest.mark.slow
def test_every_kernel_compiles_for_an_sm90_gpu_without_spilling():
    """Triton compiles each kernel at the d20 step's sizes and the engine's other branches, bf16 and fp32, for an
    H100/H200 (sm_90) here, without a GPU, and Triton's ptxas assembles it without register spills
    (tests/support/sm90_compile.py, in a process without the interpreter): what the interpreter does not check
    (tl.dot's operand shapes and dtypes, the lowering, the registers a program needs)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": PYTHONPATH}  # this checkout's kernels
    done = subprocess.run([sys.executable, str(SUPPORT / "sm90_compile.py")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(" ok ") == 28, done.stdout  # 14 variants x bf16 and fp32
