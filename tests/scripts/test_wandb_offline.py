"""wandb through nanochat.wandb_utils with no network: an offline run records the logged keys on disk,
a dummy or non-zero rank run is the no-op DummyWandb, and online mode without a key is one clear error.

Each real-wandb case runs in a fresh interpreter: wandb keeps process-wide state (its service, the
settings read from the environment at first use) that would leak between tests."""

import json
import os
import subprocess
import sys

import pytest
from helpers import PYTHONPATH, REPO

from nanochat.common import DummyWandb
from nanochat.wandb_utils import init_wandb, log_samples_table

OFFLINE_RUN = """
import json, sys
from nanochat.wandb_utils import init_wandb, log_samples_table
run = init_wandb("offline_test", "nanochat-rl-test", {"num_samples": 4, "matrix_lr": 0.02}, rank=0)
for step in range(3):
    run.log({"step": step, "reward_mean": 0.25 * step, "seq_len_mean_probe": 10.0 + step})
log_samples_table(run, [("What is 2+3?", "5 #### 5", 1.0), ("What is 4*4?", "15 #### 15", 0.0)], step=2)
run.finish()
print(json.dumps({"type": type(run).__name__, "mode": run.settings.mode}))
"""


def wandb_env(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE=mode, WANDB_DIR=str(tmp_path), WANDB_SILENT="true", HOME=str(tmp_path / "home"),
               WANDB_CONFIG_DIR=str(tmp_path / "config"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=PYTHONPATH)
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def run_python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_offline_run_records_logged_keys(tmp_path):
    proc = run_python(OFFLINE_RUN, wandb_env(tmp_path, "offline"))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info == {"type": "Run", "mode": "offline"}

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    records = list(runs[0].glob("run-*.wandb"))
    assert len(records) == 1
    data = records[0].read_bytes()
    # the history keys, the config and the run name are in the run's record (protobuf, keys as plain bytes)
    for key in (b"reward_mean", b"seq_len_mean_probe", b"samples", b"num_samples", b"matrix_lr", b"offline_test"):
        assert key in data, key
    # the samples table is written as a json file with our columns and rows
    tables = list(runs[0].glob("files/media/table/samples_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "question", "completion", "reward"]
    assert table["data"] == [[2, "What is 2+3?", "5 #### 5", 1.0], [2, "What is 4*4?", "15 #### 15", 0.0]]


@pytest.mark.slow
def test_online_without_api_key_is_a_user_error(tmp_path):
    """No key and no network: wandb refuses locally; we turn that into a WandbStartError naming the run and the
    environment fixes, which a script (run_main) prints as one line with the flag that turns wandb off."""
    code = ("from nanochat.cli import run_main\n"
            "from nanochat.wandb_utils import WandbStartError, init_wandb\n"
            "def main(argv):\n"
            "    try:\n"
            "        init_wandb('r', 'p', {}, rank=0)\n"
            "    except WandbStartError as e:\n"
            "        print('LIBRARY', e.run_name, e, flush=True)\n"
            "        raise\n"
            "run_main(main, [])\n")
    proc = run_python(code, wandb_env(tmp_path, "online"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.startswith("LIBRARY r ") and "WANDB_MODE=offline" in proc.stdout and "--run" not in proc.stdout
    error = proc.stderr.splitlines()[-1]
    assert error.startswith("error: wandb could not start run 'r'") and error.endswith("pass --run=dummy to turn wandb off")
    assert not list((tmp_path / "wandb").glob("run-*"))


def test_dummy_and_non_master_ranks_get_dummy(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert isinstance(init_wandb("dummy", "p", {}, rank=0), DummyWandb)
    run = init_wandb("real_name", "p", {}, rank=1)
    assert isinstance(run, DummyWandb)
    log_samples_table(run, [("q", "c", 1.0)], step=0)  # no-op, no wandb import needed
    run.log({"a": 1})
    run.finish()
    assert list(tmp_path.iterdir()) == []  # nothing was written
