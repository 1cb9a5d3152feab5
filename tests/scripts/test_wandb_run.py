"""A real chat_rl run with --run set, logged by wandb in offline mode, read back record by record: the run's
name, project and config, every step's metrics and every eval's pass@k as the checkpoint's history has them, and
the samples table with each completion's reward recomputed from its text.

wandb (0.31) has no public reader of an offline run, so the run file is read as wandb writes it: a leveldb-style
log (a 7-byte header ':W&B', magic 0xBEE1, version 0; then 32 KiB blocks of records, each with a 7-byte header:
crc32, length, type FULL/FIRST/MIDDLE/LAST) of wandb.proto Record messages; tables are JSON files under
files/media/table/. pyproject's test extras pin the wandb version this layout was checked with as a minimum."""

import json
import os
import struct
import subprocess
import sys

import pytest
from helpers import PYTHONPATH, REPO, TINY_RL_FLAGS

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path):
    """The wandb.proto Records of an offline run file, in the order they were written."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not the wandb run-file layout these tests read"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:
            break
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def items(updates):
    """{key: value} of a history row or a config update. wandb writes a key as `key` or as `nested_key`, the path
    of a nested value: a logged table {"samples": {"path": ...}} reads as "samples/path"."""
    return {(u.key or "/".join(u.nested_key)): json.loads(u.value_json) for u in updates}


@pytest.mark.slow
def test_chat_rl_run_logs_its_config_metrics_evals_and_samples_to_wandb(sft, base_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true", HOME=str(tmp_path / "home"),
               WANDB_CONFIG_DIR=str(tmp_path / "config"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
    (tmp_path / "home").mkdir()
    flags = [f for f in TINY_RL_FLAGS if not f.startswith("--eval-every")]
    proc = subprocess.run([sys.executable, "-m", "scripts.chat_rl", *flags, "--run=wandb_probe", "--num-steps=2",
                           "--eval-every=1", "--eval-examples=2", "--eval-tasks=arithmetic"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((base_dir / "chatrl_checkpoints" / "d2" / "meta_000001.json").read_text())

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    records = read_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project) == ("wandb_probe", "nanochat-rl")
    config = items(run.config.update)
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update(items(r.config.update))
    assert {k: config[k] for k in ("run", "task", "num_samples", "num_steps", "device_batch_size")} == {
        "run": "wandb_probe", "task": "rl_toy_task:ParityTask", "num_samples": 4, "num_steps": 2, "device_batch_size": 2}
    assert config["dtype"] == meta["user_config"]["dtype"] == "float32"

    rows = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    steps = [row for row in rows if "reward" in row]
    assert len(steps) == 2
    for logged, kept in zip(steps, meta["history"]):  # every metric of the step record, as the checkpoint keeps it
        assert {k: logged[k] for k in kept} == pytest.approx(kept, rel=1e-12)
    evals = [row for row in rows if "pass@1" in row]
    assert [row["step"] for row in evals] == [0, 1, 2]
    assert all("eval/arithmetic/pass@1" in row for row in evals)  # --eval-tasks: each eval, as the history keeps it
    for row, (step, passk) in zip(evals, meta["eval_history"]):
        assert row["step"] == step and {k: row[k] for k in passk} == pytest.approx(passk, rel=1e-12)

    tables = [row for row in rows if "samples/path" in row]  # a table is logged as a reference to its file
    assert [row["step"] for row in tables] == [0, 1]  # every eval step (--eval-every=1) that trains
    for row in tables:
        assert row["samples/_type"] == "table-file"
        table = json.loads((run_dir / "files" / row["samples/path"]).read_text())
        assert table["columns"] == ["step", "question", "completion", "reward"]
        assert len(table["data"]) == 4  # --num-samples of rank 0's first question of the step
        for step, question, completion, reward in table["data"]:
            assert step == row["step"] and question.startswith("question ")
            assert reward == (1.0 if len(completion) % 2 == 0 else 0.0)  # ParityTask: an even-length answer
