"""The pretend-CUDA guard (conftest's docstring) is on: a test that leaves the device to autodetection gets
CUDA, in this process and in every kind of Python process the tests start, on CI as on a GPU machine. If these
fail, the rest of the suite no longer shows code that would pick the GPU where a test meant the CPU."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import PYTHONPATH, REPO

from nanochat.common import autodetect_device_type

# what a child says: CUDA visible to it, and to a multiprocessing child it spawns
PROBE = """import multiprocessing, torch
with multiprocessing.get_context("spawn").Pool(1) as pool:
    print(torch.cuda.is_available(), pool.apply(torch.cuda.device_count) >= 1)"""


def test_this_process_sees_cuda():
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
    assert autodetect_device_type() == "cuda"


@pytest.mark.slow
def test_subprocesses_see_cuda():
    """The ways the tests start Python: with helpers.PYTHONPATH in their environment, with the session's
    environment inherited, and as a torchrun rank."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "--no-python"]
    for cmd, env in (([sys.executable, "-c", PROBE], {**os.environ, "PYTHONPATH": PYTHONPATH}),
                     ([sys.executable, "-c", PROBE], None),
                     ([*torchrun, sys.executable, "-c", PROBE], None)):
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "True True", (cmd, out.stdout + out.stderr)
