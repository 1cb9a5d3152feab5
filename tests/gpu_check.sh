#!/usr/bin/env bash
# Everything that needs a CUDA GPU, measured and checked on one (CI has no GPU), in three stages that each fit one
# 10-minute call:
#
#   bash tests/gpu_prepare.sh SHARED_DIR               # where the shared data and a package registry are
#   bash tests/gpu_check.sh [checks|suite|speedrun] [OUT_DIR]     # there (carry gpu_carry), one stage per call
#
# checks (the default):
# 1. the GPU tests (tests/test_cuda.py: NCCL under torchrun, bf16 vs fp32 step, a real out-of-memory, chat_sft
#    and chat_eval on CUDA, checkpoints across devices; CUDA-graph replay equal to the static step it captures),
#    with the static decode and sampler-gap tests beside them;
# 2. the d20 rollout benchmark (nanochat's January-2026 d20 shapes, random weights, GSM8K prompts, 16
#    questions x 16 samples x 256 tokens, every row forced to run to the cap): eager bf16 decoding, the static
#    step run eagerly and the same step replayed from CUDA graphs, 5 consecutive steps each (first and last
#    rollout time), tokens checked equal (graph against static: the same shapes), decode ms per step against the
#    memory-bandwidth bound, and training of a full batch (advantages forced to +-1 so a random model trains).
# suite: the whole test suite on the GPU machine, the `cuda` tests run, not skipped (gpu_suite.log).
# speedrun: `bash speedrun.sh` on a fresh base dir (the bootstrap path), timed, with its report (speedrun.log,
#    speedrun_report.md): the target is under 5 minutes with pass@1 up by at least 4 standard errors.
#
# With gpu_carry/ present, a venv over this machine's python (its CUDA torch kept) gets the carried wheels,
# NANOCHAT_BASE_DIR defaults to gpu_carry/base (its tokenizer has nanochat's 65,536 tokens, which the d20 preset
# needs), NANOCHAT_GSM8K_DIR to gpu_carry/gsm8k, and the datasets stand-in goes on PYTHONPATH. Results go to
# OUT_DIR (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-checks}
out=${2:-out}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -d gpu_carry ]; then
    if [ ! -f gpu_carry/venv/installed ]; then  # a marker: a venv whose install failed is made again
        "$python" -c "import sys; assert sys.version_info[:2] == (3, 12), 'gpu_carry/wheels are for python 3.12'" || exit 2
        rm -rf gpu_carry/venv
        "$python" -m venv --system-site-packages gpu_carry/venv || exit 2
        gpu_carry/venv/bin/python -m pip install --quiet --no-index --find-links gpu_carry/wheels \
            "wandb>=0.31" rustbpe matplotlib tqdm || exit 2
        touch gpu_carry/venv/installed
    fi
    python=$PWD/gpu_carry/venv/bin/python
    export PATH="$PWD/gpu_carry/venv/bin:$PATH"
    export NANOCHAT_BASE_DIR=${NANOCHAT_BASE_DIR:-$PWD/gpu_carry/base}
    export NANOCHAT_GSM8K_DIR=${NANOCHAT_GSM8K_DIR:-$PWD/gpu_carry/gsm8k}
    # the json-only `datasets` stand-in for the scripts (they never import it with a local GSM8K directory); the
    # suite goes without it: test_gsm8k compares the local order with the real datasets' shuffle where installed
    [ "$stage" = suite ] || export PYTHONPATH="$PWD/gpu_carry/offline${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 2
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee "$out/gpu.txt"

case "$stage" in
checks)
    "$python" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_static_decode.py tests/test_sampler_gap.py \
        2>&1 | tee "$out/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}
    "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16,batched_bf16_static,batched_bf16_graph \
        --early-stop-mean=0 --no-signal-fractions= --repeat=5 --force-advantages --memory-budget-gb=16 \
        --output="$out/bench_d20.json" 2>&1 | tee "$out/bench_d20.log"
    bench_rc=${PIPESTATUS[0]}
    echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc"
    [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
    ;;
suite)
    "$python" -m pytest -q -p no:cacheprovider -rs tests 2>&1 | tee "$out/gpu_suite.log"
    exit "${PIPESTATUS[0]}"
    ;;
speedrun)
    base=$(mktemp -d)
    start=$(date +%s)
    NANOCHAT_BASE_DIR=$base SPEEDRUN_SKIP_INSTALL=1 bash speedrun.sh 2>&1 | tee "$out/speedrun.log"
    rc=${PIPESTATUS[0]}
    echo "gpu_check: speedrun exit $rc in $(( $(date +%s) - start )) s" | tee -a "$out/speedrun.log"
    cp "$base/report/report.md" "$out/speedrun_report.md" 2>/dev/null
    exit "$rc"
    ;;
*)
    echo "gpu_check: unknown stage $stage; use checks, suite or speedrun" >&2
    exit 2
    ;;
esac
