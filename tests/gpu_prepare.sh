#!/usr/bin/env bash
# Builds gpu_carry/ (git-ignored): what tests/gpu_check.sh needs on a GPU machine that has a Python >= 3.10 with a
# CUDA torch and nothing else: no network, none of the developers' shared data, no pytest. A developer's tool, not a
# test: run it where that shared data and a package registry are, then carry gpu_carry to the GPU machine:
#
#   bash tests/gpu_prepare.sh SHARED_DIR [PYTHON_VERSION ...]   # SHARED_DIR holds gpu/tokenizer-65536, gpu/offline,
#                                                                # data/gsm8k; versions: default 3.10 3.11 3.12
#   GPU_EXTRA="numpy matplotlib" bash tests/gpu_prepare.sh SHARED_DIR 3.12   # also these, for a python without them
#   SUITE_PYTHON="3.11" bash tests/gpu_prepare.sh SHARED_DIR   # the suite stage's wandb for 3.11 (default: 3.12)
#
# gpu_carry/base/tokenizer   a 65,536-token tokenizer (nanochat's vocabulary size; the d20 preset needs it)
# gpu_carry/gsm8k            GSM8K's train.jsonl and test.jsonl
# gpu_carry/offline          a json-only stand-in for `datasets` (pyarrow's wheel alone is over the 64 MiB a
#                            device call may carry; the GSM8K path never imports datasets with a local directory)
# gpu_carry/wheels           for CPython 3.10-3.12 on Linux x86-64: pip (run from its wheel where the python has no
#                            pip), pytest, tiktoken, rustbpe, tqdm and everything they need (~13 MB); for the
#                            SUITE_PYTHON versions also wandb, which only the suite stage needs (~30 MB with its
#                            dependencies). numpy and matplotlib (~13 and ~24 MB per Python version) come with most
#                            CUDA torch installs and do not fit in 64 MiB for three versions: GPU_EXTRA adds them
#                            for the versions given.
# gpu_check.sh installs from these only what the machine's python lacks, once (see there).
#
# Run again, it starts gpu_carry afresh (pip's own cache keeps that quick), so no wheel of an earlier choice stays.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash tests/gpu_prepare.sh SHARED_DIR [PYTHON_VERSION ...] (SHARED_DIR: the folder with gpu/ and data/gsm8k/)" >&2; exit 2; }
shared=$1
shift
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.11 3.12)
carry=gpu_carry
python=${PYTHON:-python3}
limit_mb=64  # what one device call carries: the working tree and the carried folders together
for need in gpu/tokenizer-65536/tokenizer.pkl gpu/offline/datasets/__init__.py data/gsm8k/train.jsonl; do
    [ -f "$shared/$need" ] || { echo "gpu_prepare: $shared/$need is missing; give the shared directory as the argument" >&2; exit 2; }
done
rm -rf "$carry"
mkdir -p "$carry/base/tokenizer" "$carry/gsm8k" "$carry/offline" "$carry/wheels"
cp "$shared"/gpu/tokenizer-65536/* "$carry/base/tokenizer/"
cp "$shared"/data/gsm8k/train.jsonl "$shared"/data/gsm8k/test.jsonl "$carry/gsm8k/"
cp -r "$shared/gpu/offline/datasets" "$carry/offline/"
# the requirements gpu_check.sh checks (tests/gpu_requirements.txt), less numpy and matplotlib unless asked for
mapfile -t packages < <(python3 tests/gpu_requirements.py --list tests/gpu_requirements.txt | grep -Ev '^(numpy|matplotlib)\b')
mapfile -t suite_only < <(python3 tests/gpu_requirements.py --list --suite-only tests/gpu_requirements.txt)
read -r -a extra <<< "${GPU_EXTRA:-}"
read -r -a suite_versions <<< "${SUITE_PYTHON:-3.12}"
for v in "${versions[@]}"; do
    wanted=(pip "${packages[@]}" "${extra[@]}")
    [[ " ${suite_versions[*]} " == *" $v "* ]] && wanted+=("${suite_only[@]}")
    echo "gpu_prepare: wheels for python $v: ${wanted[*]}"
    "$python" -m pip download --quiet --only-binary=:all: --python-version "$v" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$carry/wheels" "${wanted[@]}" \
        2>&1 | { grep -v "^WARNING: Location" || true; }  # pip's exit status stays (pipefail)
done
if [[ " ${extra[*]} " != *" numpy "* ]]; then  # a dependency pulls it in; the machine's own numpy serves
    rm -f "$carry"/wheels/numpy-*.whl
fi
du -sh "$carry" "$carry/wheels"
tree_mb=$(git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1)
carry_mb=$(du -sm "$carry" | cut -f1)
echo "gpu_prepare: $carry ${carry_mb} MB + the working tree ${tree_mb} MB of the ${limit_mb} MiB a device call carries"
[ $((carry_mb + tree_mb)) -lt "$limit_mb" ] || {
    echo "gpu_prepare: over the limit; give fewer python versions (the GPU machine's: python3 --version there) or fewer GPU_EXTRA packages" >&2
    exit 1
}
