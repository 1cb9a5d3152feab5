#!/usr/bin/env bash
# The test suite in one command, on a fresh machine or on one that ran it before:
#
#   bash tests/run.sh                               # every test
#   bash tests/run.sh tests/engine/test_engine.py -k tool  # arguments go to pytest (in place of `tests`)
#   NANOCHAT_TEST_WORKERS=0 bash tests/run.sh            # every test in this one process, in file order
#   NANOCHAT_TEST_WORKERS=0 NANOCHAT_TEST_ORDER=reverse bash tests/run.sh  # ... in reversed file order
#
# 1. creates .venv (python3 -m venv), or reuses it;
# 2. installs torch into it unless it already has one: the CPU build (torch==2.13.0), or, where nvidia-smi
#    shows an NVIDIA GPU, a CUDA build (PyPI's torch for Linux);
# 3. installs this package with its test extras (pip install -e ".[test]");
# 4. prints one line naming the CPU, its bf16 support, torch's version and thread count;
# 5. runs pytest, one pytest-xdist worker per core (at most 4; NANOCHAT_TEST_WORKERS=N sets N, 0 runs in this
#    process), each computing on one thread, and exits with pytest's exit code.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
venv_python=.venv/bin/python
if ! { [ -x "$venv_python" ] && "$venv_python" -c "import sys" >/dev/null 2>&1; }; then
    [ -e .venv ] && echo "tests/run.sh: .venv is broken (its python does not run); recreating it"
    rm -rf .venv
    "$python" -m venv .venv
fi

if "$venv_python" -c "import torch" >/dev/null 2>&1; then
    :  # keep the torch the venv has (a CUDA build someone installed stays)
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "tests/run.sh: NVIDIA GPU found: installing a CUDA build of torch into .venv"
    "$venv_python" -m pip install --quiet torch
else
    echo "tests/run.sh: installing the CPU build of torch into .venv"
    "$venv_python" -m pip install --quiet torch==2.13.0  # pinned: an unpinned torch pulls GBs of CUDA wheels
fi
"$venv_python" -m pip install --quiet -e ".[test]"
# which machine this is, so that a red log says which CPU kind (and bf16 path) the numbers came from
"$venv_python" -c "from nanochat.runtime.cpu_features import cpu_summary; print('tests/run.sh: ' + cpu_summary())"

# One worker per core: most tests are single-threaded (tiny models, Inductor's code generation, processes starting),
# so a 2-core machine runs two at a time in ~half the time. --dist loadfile keeps a file's tests, and the module
# fixtures they share (a trained model, compiled graphs), on one worker.
workers=${NANOCHAT_TEST_WORKERS:-$("$venv_python" -c "import os; print(min(4, os.cpu_count() or 1))")}
parallel=()
[ "$workers" -gt 0 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)  # longest files first: conftest

# with arguments they replace `tests` (a path selects; with options only, pyproject's testpaths is `tests`)
[ $# -gt 0 ] || set -- tests
exec "$venv_python" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
