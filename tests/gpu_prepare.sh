#!/usr/bin/env bash
# Builds gpu_carry/ (git-ignored): what tests/gpu_check.sh needs on a GPU machine that has python 3.12 with a CUDA
# torch, triton, tiktoken, numpy and pytest, but no network, none of the developers' shared data, and not wandb,
# rustbpe, matplotlib, tqdm or datasets. A developer's tool, not a test: run it where that shared data is, then
# carry gpu_carry to the GPU machine:
#
#   bash tests/gpu_prepare.sh SHARED_DIR        # SHARED_DIR holds gpu/tokenizer-65536, gpu/offline, data/gsm8k
#
# gpu_carry/base/tokenizer   a 65,536-token tokenizer (nanochat's vocabulary size; the d20 preset needs it)
# gpu_carry/gsm8k            GSM8K's train.jsonl and test.jsonl
# gpu_carry/offline          a json-only stand-in for `datasets` (pyarrow's wheel alone is over the 64 MiB a
#                            device call may carry; the GSM8K path never imports datasets with a local directory)
# gpu_carry/wheels           wandb, rustbpe, matplotlib, tqdm and their dependencies for CPython 3.12 on Linux
#                            x86-64 (not numpy: the machine has it with its torch)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: bash tests/gpu_prepare.sh SHARED_DIR (the folder with gpu/ and data/gsm8k/)" >&2; exit 2; }
shared=$1
carry=gpu_carry
python=${PYTHON:-python3}
for need in gpu/tokenizer-65536/tokenizer.pkl gpu/offline/datasets/__init__.py data/gsm8k/train.jsonl; do
    [ -f "$shared/$need" ] || { echo "gpu_prepare: $shared/$need is missing; give the shared directory as the argument" >&2; exit 2; }
done
rm -rf "$carry"
mkdir -p "$carry/base/tokenizer" "$carry/gsm8k" "$carry/offline" "$carry/wheels"
cp "$shared"/gpu/tokenizer-65536/* "$carry/base/tokenizer/"
cp "$shared"/data/gsm8k/train.jsonl "$shared"/data/gsm8k/test.jsonl "$carry/gsm8k/"
cp -r "$shared/gpu/offline/datasets" "$carry/offline/"
"$python" -m pip download --quiet --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$carry/wheels" \
    "wandb>=0.31" rustbpe matplotlib tqdm 2>&1 | { grep -v "^WARNING: Location" || true; }  # pip's status stays
rm -f "$carry"/wheels/numpy-*.whl
du -sh "$carry"
[ "$(du -sm "$carry" | cut -f1)" -lt 64 ] || { echo "gpu_prepare: $carry is over the 64 MiB a device call carries" >&2; exit 1; }
