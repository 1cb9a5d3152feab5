"""Run one command per rank as separate processes that form a gloo process group on this machine."""

import os
import socket
import subprocess
import sys

from helpers import REPO


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args_for_rank, world_size=2, timeout=60, extra_env=None):
    """Start `python <args_for_rank(rank)>` for every rank with torchrun's environment variables (one thread
    each, so 2 ranks do not fight over 2 cores), wait for all, and fail with their output if any fails.
    Returns the list of (stdout, stderr)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, *args_for_rank(rank)], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert proc.returncode == 0, f"rank failed:\n{out}\n{err}"
        outputs.append((out, err))
    return outputs
