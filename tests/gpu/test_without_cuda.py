"""Asking for CUDA on a machine without it (issue 35, item 7): `--decode=graph` printed a traceback and exited 1
after the model was built; `--device-type=cuda` must fail as early. Each script that takes the flag says what to
change in one line and exits 2 before it loads, builds or writes anything.

These run without the suite's pretend CUDA (tests/conftest.py), which would answer "CUDA is here": in a child
process whose PYTHONPATH lacks tests/support/pretend_cuda, with the guard's variable unset, and with CUDA_VISIBLE_DEVICES
empty, so that torch sees no GPU on a GPU machine either."""

import json
import os
import subprocess
import sys

from conftest import PRETEND_CUDA
from helpers import REPO

# script -> flags; every one asks for CUDA (by --decode=graph on the autodetected CPU, or by --device-type=cuda)
CASES = [
    ("chat_rl", ["--decode=graph"]),
    ("chat_rl", ["--device-type=cuda"]),
    ("chat_rl", ["--device-type=cpu", "--decode=graph"]),
    ("chat_eval", ["--decode=graph"]),
    ("chat_eval", ["--device-type=cuda"]),
    ("chat_sft", ["--device-type=cuda"]),
    ("chat_cli", ["--device-type=cuda", "--prompt=hi"]),
    ("bench_rl", ["--configs=batched_bf16_graph"]),
    ("bench_rl", ["--device-type=cuda"]),
]
FIXES = {"--decode=graph": "use --decode=static", "--device-type=cuda": "use cpu or install a CUDA build of torch",
         "--configs=batched_bf16_graph": "with a *_static config"}

# runs every case's main through run_main in one interpreter (a process per case costs ~3 s of imports each)
DRIVER = """
import contextlib, io, json, sys
from nanochat.cli import run_main
results = []
for script, flags in json.loads(sys.argv[1]):
    module = __import__(f"scripts.{script}", fromlist=["main"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_main(module.main, flags)
            code = 0
        except SystemExit as e:
            code = e.code
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def without_cuda(base_dir):
    env = {k: v for k, v in os.environ.items() if k != PRETEND_CUDA.ENV}
    return {**env, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "NANOCHAT_BASE_DIR": str(base_dir)}


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def test_asking_for_cuda_without_it_is_one_line_and_exit_2_before_anything_is_built(sft, base_dir):
    before = files_under(base_dir)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(CASES)], cwd=REPO, env=without_cuda(base_dir),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    for (script, flags), result in zip(CASES, results):
        case = f"{script} {' '.join(flags)}: {result}"
        assert result["code"] == 2, case
        assert result["stdout"] == "", case  # nothing loaded: "Loading model from ..." would be here
        lines = result["stderr"].splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), case
        assert FIXES[flags[-1] if flags[-1] in FIXES else flags[0]] in lines[0], case
    assert files_under(base_dir) == before  # no run directory, report or tokenizer cache written


def test_a_real_process_exits_2_with_one_line(sft, base_dir):
    proc = subprocess.run([sys.executable, "-m", "scripts.chat_rl", "--decode=graph"], cwd=REPO,
                          env=without_cuda(base_dir), capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("error: --decode is graph, which replays CUDA graphs, and this run is on cpu (torch sees no "
                           "CUDA device, or --device-type chose another); use --decode=static (the same step, run "
                           "eagerly) or --decode=auto\n")
