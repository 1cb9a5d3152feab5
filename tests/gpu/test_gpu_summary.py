"""tests/gpu_summary.py, the one page a gpu_check.sh call's figures come back as: from real bench_rl and bench_epoch
JSON written here on a CPU (what a GPU writes, in another device's numbers), every figure it shows is the file's,
the d20 step is held against issue 57's targets, and what a part did not write is said."""

import json
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

import gpu_summary
from scripts import bench_epoch, bench_rl
from test_bench import TINY_FLAGS

GPU_LINE = "NVIDIA H200, 143771 MiB, 1980 MHz"


@pytest.fixture
def out(base_dir, tmp_path):
    """A gpu_check output folder after parts 1, 2, 5 and 7: a real bench_rl JSON (with --profile) as both the d20
    bench's and the profile's, bench_epoch's JSON from it, parts.jsonl, gpu.txt and commit.txt."""
    folder = tmp_path / "out"
    folder.mkdir()
    bench = folder / "bench_d20.json"
    bench_rl.main(TINY_FLAGS + ["--configs=batched_fp32_static", "--force-advantages", "--repeat=2",
                                "--no-signal-fractions=", "--early-stop-mean=0", "--profile=batched_fp32_static",
                                f"--output={bench}"])
    shutil.copy(bench, folder / "profile_d20.json")
    bench_epoch.main([f"--bench={bench}", "--device-type=cpu", f"--output={folder / 'epoch_d20.json'}"])
    parts = [{"part": "setup", "exit": 0, "seconds": 12, "python": "/usr/bin/python3"},
             {"part": "d20 bench", "exit": 0, "seconds": 41, "limit": 150, "log": "bench_d20.log"},
             {"part": "d20 blocks", "exit": 124, "seconds": 180, "limit": 180, "log": "blocks_d20.log"}]
    (folder / "parts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in parts))
    (folder / "gpu.txt").write_text("name, memory.total [MiB], clocks.max.sm [MHz]\n" + GPU_LINE + "\n")
    (folder / "commit.txt").write_text("6d8f80d\n")
    return folder


def test_the_summary_shows_each_files_figures_and_the_targets(out):
    text = gpu_summary.summary(str(out))
    bench = json.loads((out / "bench_d20.json").read_text())
    result = bench["results"]["batched_fp32_static"]
    assert f"GPU: {GPU_LINE}; torch {bench['machine']['torch']}; python {bench['machine']['python']}; commit 6d8f80d" in text
    assert "| d20 blocks | 124 | 180 | 180 |" in text and "| setup | 0 | 12 | - |" in text
    row = next(line for line in text.splitlines() if line.startswith("| bench_d20.json | batched_fp32_static |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:7] == [f"{result[k]:.2f}" for k in ("decode_ms_per_step", "bandwidth_bound_ms", "rollout_seconds",
                                                        "train_seconds", "step_seconds")]
    assert cells[-1] == result["tokens_digest"] and cells[-3] == str(result["captures_each"][0])
    for name in ("blocks_d20.json", "flex_d20.json", "compiled_d20.json"):  # the parts that wrote nothing
        assert name in text.split("Not written")[1].splitlines()[0]
    step = result["step_seconds"]
    assert f"| step | {step:.2f} s | <= 2.5 s | {'yes' if step <= 2.5 else 'no'} |" in text
    minutes = json.loads((out / "epoch_d20.json").read_text())["epoch"]["minutes"]
    assert f"| d20 epoch estimate | {minutes:.1f} min | <= 20 min | {'yes' if minutes <= 20 else 'no'} |" in text
    split = bench["profile_split"]["batched_fp32_static"]["rollout"]
    assert f"| rollout | {split['wall_s']:.3f} | {split['gpu_busy_s']:.3f} | {split['gaps_s']:.3f} | 0 |" in text
    result["step_seconds"] += 2.5  # a step over its target is said to miss it
    (out / "bench_d20.json").write_text(json.dumps(bench))
    assert f"| step | {result['step_seconds']:.2f} s | <= 2.5 s | no |" in gpu_summary.summary(str(out))


def test_a_flex_compile_that_failed_is_said(out):
    """flex_d20.json as a GPU writes it when Inductor failed on FlexAttention: the summary says the timing was the
    eager reference's; when it compiled, its graphs and seconds."""
    bench = json.loads((out / "bench_d20.json").read_text())
    result = bench["results"].pop("batched_fp32_static")
    failed = {**result, "flex_compile": {"compiles": 0, "seconds": 3.5, "failed": "LoweringException: no"}}
    compiled = {**result, "flex_compile": {"compiles": 2, "seconds": 21.25, "failed": None}}
    bench["results"] = {"batched_bf16_graph_flex": failed, "batched_bf16_graph_compiled_flex": compiled}
    (out / "flex_d20.json").write_text(json.dumps(bench))
    text = gpu_summary.summary(str(out))
    assert "- batched_bf16_graph_flex: FAILED, the eager reference ran: LoweringException: no" in text
    assert "- batched_bf16_graph_compiled_flex: 2 graphs in 21.2 s" in text
    assert "flex_d20.json" not in text.split("Not written")[1].splitlines()[0]


def test_an_empty_folder_and_a_bad_argument(tmp_path):
    """A call stopped in its setup leaves nothing but the folder: the page says so; the script writes it to
    summary.md; a missing folder is a usage line and exit 2."""
    script = str(REPO / "tests" / "gpu_summary.py")
    done = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == (tmp_path / "summary.md").read_text()
    assert "no part finished" in done.stdout and "no benchmark file" in done.stdout
    assert "no d20 step measured" in done.stdout and "GPU: unknown; torch unknown" in done.stdout
    bad = subprocess.run([sys.executable, script, str(tmp_path / "absent")], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage: python tests/gpu_summary.py OUT_DIR" in bad.stderr
