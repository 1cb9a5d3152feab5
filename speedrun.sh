#!/usr/bin/env bash
# speedrun.sh: from a fresh clone to an RL-trained chat model, its evals and a report, in one command.
#
#   bash speedrun.sh                                            # CPU, or every GPU of this machine
#   NANOCHAT_GSM8K_DIR=/path/to/gsm8k bash speedrun.sh          # offline: GSM8K's train/test.jsonl from disk
#
# 1. A virtual environment (.venv) with this package and its dependencies.
# 2. GSM8K into $NANOCHAT_BASE_DIR/data/gsm8k: from $NANOCHAT_GSM8K_DIR when set, else from the Hugging Face hub.
# 3. A chat model. With an SFT checkpoint already in $NANOCHAT_BASE_DIR/chatsft_checkpoints (yours, from
#    nanochat) it is used as is. Without one, a tokenizer and a small model are trained from scratch on the
#    arithmetic task (tasks/arithmetic.py): a tiny one on CPU (about 2 minutes), a larger one on GPU.
# 4. chat_eval before RL, chat_rl, chat_eval after RL.
#      GPU + your SFT checkpoint: nanochat's GSM8K RL with its defaults, on all GPUs through torchrun.
#      Otherwise: RL on the arithmetic task, sized so the whole script takes under 20 minutes on a 2-core CPU.
# 5. Prints where the report is ($NANOCHAT_BASE_DIR/report/report.md).
#
# Settings (environment variables; the defaults are the CPU demo):
#   NANOCHAT_BASE_DIR      where everything is written (default ~/.cache/nanochat)
#   NANOCHAT_GSM8K_DIR     a directory with GSM8K's train.jsonl and test.jsonl (no hub download then)
#   WANDB_RUN              wandb run name for chat_rl (default dummy: no wandb)
#   SPEEDRUN_SKIP_INSTALL  1: use the current Python environment, create no venv
#   SPEEDRUN_DEVICE        cpu|cuda|mps (default: cuda if nvidia-smi sees a GPU, else cpu)
#   SPEEDRUN_VOCAB_SIZE, SPEEDRUN_DEPTH   the bootstrap tokenizer and model
#   SPEEDRUN_SFT_BAND      the bootstrap SFT stops when its held-out sampled pass@1 is in this band (default 0.3:0.6,
#                          checked every SPEEDRUN_SFT_CHECK_EVERY steps, at most SPEEDRUN_SFT_STEPS steps);
#                          empty: exactly SPEEDRUN_SFT_STEPS steps
#   SPEEDRUN_RL_STEPS, SPEEDRUN_EVAL_EVERY, SPEEDRUN_RL_EVAL_EXAMPLES  the arithmetic RL run and its evals
#   SPEEDRUN_EVAL_EXAMPLES  questions of the chat_eval before and after RL (400)
set -euo pipefail
cd "$(dirname "$0")"
SECONDS=0
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$( (nproc 2>/dev/null || echo 1) | tr -d ' ')}"
mkdir -p "$NANOCHAT_BASE_DIR"
stage() { echo; echo "=== [$(printf '%02d:%02d' $((SECONDS / 60)) $((SECONDS % 60)))] $*"; }

if [ -n "${SPEEDRUN_DEVICE:-}" ]; then
    DEVICE="$SPEEDRUN_DEVICE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DEVICE=cuda
else
    DEVICE=cpu
fi

# -----------------------------------------------------------------------------
stage "1/5 environment"
if [ "${SPEEDRUN_SKIP_INSTALL:-0}" != "1" ]; then
    [ -d .venv ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    source .venv/bin/activate
    python -m pip install --quiet --upgrade pip
    if [ "$DEVICE" = cuda ]; then
        python -m pip install --quiet torch            # the registry's CUDA build
    else
        python -m pip install --quiet "torch==2.13.0"  # pinned: an unpinned torch pulls multi-GB CUDA wheels
    fi
    python -m pip install --quiet -e .
fi
python -c "import torch; print(f'torch {torch.__version__}, device {\"$DEVICE\"}, {torch.get_num_threads()} threads')"

# -----------------------------------------------------------------------------
stage "2/5 GSM8K"
python -m scripts.prepare_gsm8k  # from $NANOCHAT_GSM8K_DIR when set, else the hub

# -----------------------------------------------------------------------------
stage "3/5 SFT checkpoint"
have_sft_checkpoint() { compgen -G "$NANOCHAT_BASE_DIR/chatsft_checkpoints/*/model_*.pt" >/dev/null; }
if have_sft_checkpoint && [ -f "$NANOCHAT_BASE_DIR/speedrun_bootstrap" ]; then
    BOOTSTRAPPED=1
    echo "using the SFT checkpoint an earlier speedrun bootstrapped in $NANOCHAT_BASE_DIR/chatsft_checkpoints"
elif have_sft_checkpoint; then
    BOOTSTRAPPED=0
    echo "using your SFT checkpoint in $NANOCHAT_BASE_DIR/chatsft_checkpoints"
else
    BOOTSTRAPPED=1
    if [ "$DEVICE" = cuda ]; then
        DEPTH="${SPEEDRUN_DEPTH:-8}"; SFT_STEPS="${SPEEDRUN_SFT_STEPS:-1500}"; VOCAB="${SPEEDRUN_VOCAB_SIZE:-8192}"
        CHECK_EVERY="${SPEEDRUN_SFT_CHECK_EVERY:-10}"
    else
        DEPTH="${SPEEDRUN_DEPTH:-4}"; SFT_STEPS="${SPEEDRUN_SFT_STEPS:-300}"; VOCAB="${SPEEDRUN_VOCAB_SIZE:-2048}"
        CHECK_EVERY="${SPEEDRUN_SFT_CHECK_EVERY:-5}"
    fi
    BAND="${SPEEDRUN_SFT_BAND-0.3:0.6}"
    echo "no SFT checkpoint in $NANOCHAT_BASE_DIR/chatsft_checkpoints: bootstrapping a d$DEPTH model on the arithmetic task"
    if [ ! -f "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.pkl" ]; then
        python -m scripts.tok_train --vocab-size="$VOCAB"
    fi
    # Stopped early on purpose, on held-out accuracy rather than a step count (the curve is steep, and how
    # fast it climbs depends on the machine): the model gets partial credit and RL has something to improve.
    STOP=()
    # a check samples 32 held-out questions 4 times, up to 64 tokens (solutions take ~50): a few seconds on a CPU
    [ -n "$BAND" ] && STOP=(--stop-at-pass1="$BAND" --stop-check-every="$CHECK_EVERY" --stop-check-questions=32
                            --stop-check-samples=4 --stop-check-max-tokens=64)
    # on a GPU a step's 32 conversations go through in one forward (4 at a time leaves it waiting on launches)
    ROWS=()
    [ "$DEVICE" = cuda ] && ROWS=(--device-batch-size=32)
    python -m scripts.chat_sft --depth="$DEPTH" --tasks=arithmetic --num-steps="$SFT_STEPS" --eval-every=-1 \
        --device-type="$DEVICE" ${STOP[@]+"${STOP[@]}"} ${ROWS[@]+"${ROWS[@]}"}
    touch "$NANOCHAT_BASE_DIR/speedrun_bootstrap"
fi

# -----------------------------------------------------------------------------
if [ "$BOOTSTRAPPED" = 0 ] && [ "$DEVICE" = cuda ]; then
    TASK=gsm8k
    NGPU="$(nvidia-smi -L | wc -l | tr -d ' ')"
    EVAL_FLAGS=(--task=gsm8k --num-examples="${SPEEDRUN_EVAL_EXAMPLES:-400}")
    RL=(torchrun --standalone --nproc_per_node="$NGPU" -m scripts.chat_rl -- --run="${WANDB_RUN:-dummy}")
    EVAL=(torchrun --standalone --nproc_per_node="$NGPU" -m scripts.chat_eval --)
else
    TASK=arithmetic
    EVAL_EXAMPLES="${SPEEDRUN_EVAL_EXAMPLES:-400}"
    EVAL_FLAGS=(--task=arithmetic --num-examples="$EVAL_EXAMPLES" --max-new-tokens=128 --device-type="$DEVICE")
    # nanochat's learning rates and 16 questions per step, with 8 samples each (not 16) and completions capped
    # at 128 tokens (solutions take ~50), so a step takes ~5.5 s on 2 CPU cores in fp32; 100 steps, with
    # pass@k on 100 test questions every 50, keep the whole speedrun under 20 minutes there. Larger lrs make
    # the tiny model's reward collapse (measured: init-lr-frac 0.15 and 0.5).
    RL=(python -m scripts.chat_rl --run="${WANDB_RUN:-dummy}" --task=arithmetic --device-type="$DEVICE"
        --examples-per-step=16 --num-samples=8 --device-batch-size=8 --max-new-tokens=128
        --num-steps="${SPEEDRUN_RL_STEPS:-100}" --eval-every="${SPEEDRUN_EVAL_EVERY:-50}"
        --eval-examples="${SPEEDRUN_RL_EVAL_EXAMPLES:-100}" --save-every=-1 --overwrite)
    EVAL=(python -m scripts.chat_eval)
fi

stage "4/5 eval before RL, RL on $TASK, eval after RL"
"${EVAL[@]}" --source=sft "${EVAL_FLAGS[@]}"
"${RL[@]}"
"${EVAL[@]}" --source=rl "${EVAL_FLAGS[@]}"

# -----------------------------------------------------------------------------
stage "5/5 done"
python - <<'EOF'
import json, os
report = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "report")
for source in ("sft", "rl"):
    with open(os.path.join(report, f"chat_eval_{source}.json")) as f:
        r = json.load(f)
    print(f"{source:>3}: greedy pass@1 {r['greedy_pass@1']:.4f}, sampled pass@1 {r['pass@k_unbiased']['1']:.4f}")
EOF
echo "report: $NANOCHAT_BASE_DIR/report/report.md (total $((SECONDS / 60))m$((SECONDS % 60))s)"
