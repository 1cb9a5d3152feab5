#!/usr/bin/env bash
# Everything that needs a CUDA GPU, measured and checked in one call (CI has no GPU):
#
#   NANOCHAT_BASE_DIR=/path/with/tokenizer-65536 NANOCHAT_GSM8K_DIR=/path/to/gsm8k bash tests/gpu_check.sh [OUT_DIR]
#
# 1. the GPU tests (tests/test_cuda.py: NCCL under torchrun, bf16 vs fp32 step, a real out-of-memory, chat_sft
#    and chat_eval on CUDA, checkpoints across devices; CUDA-graph replay equal to the static step it captures),
#    with the static decode and sampler-gap tests beside them;
# 2. the d20 rollout benchmark (nanochat's January-2026 d20 shapes, random weights, GSM8K prompts, 16
#    questions x 16 samples x 256 tokens, every row forced to run to the cap): eager bf16 decoding, the static
#    step run eagerly and the same step replayed from CUDA graphs, 5 consecutive steps each (first and last
#    rollout time), tokens checked equal (graph against static: the same shapes), decode ms per step against the
#    memory-bandwidth bound, and training of a full batch (advantages forced to +-1 so a random model trains).
# $NANOCHAT_BASE_DIR/tokenizer must hold a 65,536-token tokenizer (nanochat's vocabulary size). Results go to
# OUT_DIR (default ./out): gpu_tests.log, bench_d20.json, bench_d20.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
"$python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 2
"$python" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_static_decode.py tests/test_sampler_gap.py \
    2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
"$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16,batched_bf16_static,batched_bf16_graph \
    --early-stop-mean=0 --no-signal-fractions= --repeat=5 --force-advantages --memory-budget-gb=16 \
    --output="$out/bench_d20.json" 2>&1 | tee "$out/bench_d20.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
