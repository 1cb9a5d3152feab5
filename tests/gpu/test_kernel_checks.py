"""tests/kernel_checks.py, gpu_check.sh's correctness part for the Triton kernels, shown to fail on a broken kernel:
run here in Triton's interpreter (its `interpreter` target: the same tests as on a GPU, other parameters), with
relu_square's kernel replaced by one without its relu (tests/support/broken_relu_square.py, loaded as a pytest
plugin), it exits 1 and its line, and the summary's page, name relu_square; with the kernels as they are it passes."""

import json
import os
import subprocess
import sys

import pytest
from helpers import PYTHONPATH, REPO, SUPPORT
from kernel_targets import TRITON_VERSION

import gpu_summary

pytestmark = pytest.mark.skipif(TRITON_VERSION < (3, 9), reason="the interpreter target needs Triton 3.9 or later")


def kernel_checks(out, broken):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(SUPPORT), PYTHONPATH]),
           "PYTEST_ADDOPTS": "-p broken_relu_square" if broken else ""}
    return subprocess.run([sys.executable, str(REPO / "tests" / "kernel_checks.py"), "interpreter", str(out), "-k",
                           "relu_square or residual_norm"], cwd=REPO, env=env, capture_output=True, text=True)


def test_the_kernel_checks_fail_on_a_broken_kernel_naming_its_op(tmp_path):
    broken = kernel_checks(tmp_path / "broken", broken=True)
    line = "kernel checks on interpreter: FAILED: relu_square (2 tests) disagree with their torch references"
    assert broken.returncode == 1 and broken.stdout.splitlines()[-1] == line, broken.stdout[-2000:]
    result = json.loads((tmp_path / "broken" / "kernel_checks.json").read_text())
    assert list(result["failed"]) == ["relu_square"] and result["passed"] > 0  # residual_norm's still pass
    parts = tmp_path / "broken" / "parts.jsonl"  # as gpu_check.sh's step writes it, then the part's note
    parts.write_text(json.dumps({"part": "kernel checks", "exit": 1, "seconds": 9, "limit": 150}) + "\n")
    note = [sys.executable, str(REPO / "tests" / "kernel_checks.py"), "--note", str(parts.parent)]
    assert subprocess.run(note).returncode == 0
    assert json.loads(parts.read_text())["verdict"] == line
    page = gpu_summary.summary(str(tmp_path / "broken"))
    assert line in page and "- relu_square: test_relu_square_is_the_mlps_activation[interpreter-dtype0]" in page
    fine = kernel_checks(tmp_path / "fine", broken=False)
    assert fine.returncode == 0, fine.stdout[-2000:]
    passed = result["passed"] + 2  # relu_square's two pass too
    assert fine.stdout.splitlines()[-1] == f"kernel checks on interpreter: {passed} tests passed, every op agrees"
