"""chat_rl across machines: two torchrun "nodes" on 127.0.0.1 (one gloo process each) end a run with the
weights one process reaches, and each node writes only its own checkpoint files."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from helpers import PYTHONPATH, REPO, TINY_RL_FLAGS


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(args_for_node, env_for_node, num_nodes=2, attempts=3):
    """`torchrun <args_for_node(i)>` as node i of `num_nodes` (static rendezvous, README's multi-node commands).
    Node 0's agent binds --master-port, which can only be picked free beforehand: another process may take it in
    between. Then node 0 fails at once with EADDRINUSE, and the launch is tried again on another port.
    Returns (processes, [(stdout, stderr)])."""
    for _ in range(attempts):
        port = free_port()
        nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={num_nodes}",
                                   "--nproc-per-node=1", f"--node-rank={i}", "--master-addr=127.0.0.1",
                                   f"--master-port={port}", *args_for_node(i)],
                                  cwd=REPO, env=env_for_node(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(num_nodes)]
        outputs = []
        try:
            for node in nodes:
                outputs.append(node.communicate(timeout=300))
                if node is nodes[0] and node.returncode != 0 and "EADDRINUSE" in outputs[0][1]:
                    break
        finally:
            for node in nodes:
                if node.poll() is None:
                    node.kill()
                    node.wait()
        if len(outputs) == num_nodes:
            return nodes, outputs
    raise AssertionError(f"the master port was taken {attempts} times in a row")


@pytest.mark.slow
def test_two_nodes_end_with_the_same_weights_as_one_process(sft, base_dir, tmp_path):
    """Each node gets its own copy of the base dir (no shared filesystem), as README's multi-node section
    allows: the run must not read anything another node writes. Rank 0 (node 0) writes the model and meta,
    every rank its optimizer shard, each into its own node's copy. Equality holds for the reasons given in
    test_chat_rl's two-rank test (per-question seeds, per-row random streams, gradients averaged over ranks)."""
    flags = TINY_RL_FLAGS + ["--num-steps=2", "--save-every=-1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}

    single = subprocess.run([sys.executable, "-m", "scripts.chat_rl", *flags], cwd=REPO, capture_output=True, text=True,
                            env={**env, "NANOCHAT_BASE_DIR": str(base_dir)}, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    one = torch.load(base_dir / "chatrl_checkpoints" / "d2" / "model_000001.pt", weights_only=True)

    node_dirs = [tmp_path / f"node{i}" for i in range(2)]
    for node_dir in node_dirs:  # a copy of the base dir as it was before the run
        shutil.copytree(base_dir, node_dir, ignore=shutil.ignore_patterns("chatrl_checkpoints", "report"))
    nodes, outputs = run_nodes(lambda i: ["-m", "scripts.chat_rl", "--", *flags],
                               lambda i: {**env, "NANOCHAT_BASE_DIR": str(node_dirs[i])})
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]

    run_dirs = [node_dir / "chatrl_checkpoints" / "d2" for node_dir in node_dirs]
    assert sorted(p.name for p in run_dirs[0].iterdir()) == ["meta_000001.json", "model_000001.pt", "optim_000001_rank0.pt"]
    assert sorted(p.name for p in run_dirs[1].iterdir()) == ["optim_000001_rank1.pt"]
    two = torch.load(run_dirs[0] / "model_000001.pt", weights_only=True)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5, rtol=0), key
    assert any(not torch.equal(one[k], sft.state_dict()[k]) for k in one)
    rewards = lambda out: [line.split("Average reward: ")[1].split(" ")[0] for line in out.splitlines() if "Average reward" in line]
    assert rewards(single.stdout) == rewards(outputs[0][0]) and len(rewards(single.stdout)) == 2
