"""Run one command per rank as separate processes that form a gloo process group on this machine.

The ranks meet at a TCP store this test process hosts on a port the OS assigns (port 0), bound before any rank
starts, as torchrun's agent hosts one for its workers (TORCHELASTIC_USE_AGENT_STORE tells torch's env://
rendezvous that every rank is the store's client). Picking a free port, closing it and letting rank 0 bind it
later raced with every other process on the machine: a rank lost the port now and then (a flake of issue 45)."""

import os
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist
from helpers import REPO


class Ranks(list):
    """The processes of one launch; they hold the store the ranks meet at for as long as they are referenced."""


def start_ranks(args_for_rank, world_size=2, env=None):
    """Start `python <args_for_rank(rank)>` for every rank in REPO with `env` (default: this process's) plus
    torchrun's per-rank variables, meeting at a store hosted here. Returns the Ranks."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
              "WORLD_SIZE": str(world_size)}
    ranks = Ranks(subprocess.Popen([sys.executable, *args_for_rank(rank)], cwd=REPO, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env={**(os.environ if env is None else env), **launch,
                                        "RANK": str(rank), "LOCAL_RANK": str(rank)})
                  for rank in range(world_size))
    ranks.store = store
    return ranks


def run_ranks(args_for_rank, world_size=2, timeout=60, extra_env=None):
    """Start `python <args_for_rank(rank)>` for every rank with torchrun's environment variables (one thread
    each, so 2 ranks do not fight over 2 cores), wait for all, and fail with their output if any fails.
    Returns the list of (stdout, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(extra_env or {}))
    procs = start_ranks(args_for_rank, world_size, env)
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank failed:\n{out}\n{err}"
            outputs.append((out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs
