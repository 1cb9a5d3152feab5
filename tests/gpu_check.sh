#!/usr/bin/env bash
# Everything that needs a CUDA GPU, measured and checked on one (CI has no GPU), in stages that each finish in one
# call of under 8 minutes (each step runs under a timeout and prints its own time):
#
#   bash tests/gpu_prepare.sh SHARED_DIR                        # where the shared data and a package registry are
#   bash tests/gpu_check.sh [checks|kernels|compiled|suite|speedrun|env] [OUT_DIR]   # on the GPU machine (carry gpu_carry)
#   bash tests/gpu_check.sh checks,compiled [OUT_DIR]   # several stages in one call (560 s, shared by weight)
#
# checks (the default), one call of at most 8 minutes in eleven parts, each under a timeout, each adding one JSON line
# to OUT_DIR/parts.jsonl as it ends (part, exit, seconds, limit, log), and remaking OUT_DIR/results.tgz (every file,
# since a device call brings back 8 at most), so that a call stopped at its limit keeps what finished; in the order
# of what they decide, the measurements first:
# 1. setup (below);
# 1b. the Triton kernels' correctness (tests/kernel_checks.py cuda: each kernel op against its torch reference on the
#    tests' hand-made states, fp32 and bf16, and a greedy fp32 rollout against the torch step, compiled on this GPU;
#    kernel_checks.json, the summary names an op that disagreed): before any timing; where it fails, the part fails
#    (the stage's exit too) and part 2b's timing of the Triton step is skipped (parts.jsonl says so);
# 2. the d20 bench (nanochat's January-2026 d20 shapes, random weights, GSM8K prompts, 16 questions x 16 samples x
#    256 tokens, rows to the cap, advantages forced to +-1 so the whole batch trains), the graph decode step, 3
#    consecutive steps: chat_rl's own step (bench_d20.json, written after each config);
# 2b. the bench of part 2 with the step in the project's Triton kernels (triton_d20.json: decode ms, captures' seconds
#    with Triton's JIT, tokens_digest beside part 2's), which decides the engine's default on CUDA (issue 66); only
#    after part 1b passed;
# 3. the same bench with --compile=blocks (blocks_d20.json): each block compiled around its attention, once for
#    every layer, in rollouts (captured in the engine's graphs) and training: compile seconds, decode ms, train s;
# 4. the bench of part 2 with the shared-prompt attention through FlexAttention, compiled by Inductor alone (the step
#    around it as part 2's), flex_d20.json: its compile seconds (and flex_compile: whether it compiled) and decode ms
#    against part 2's hand-written attention (which of the two a GPU runs faster); its tokens_digest beside part 2's
#    (bf16 near-ties may fall otherwise); the CUDA tests hold its attention to the hand-written one's on set states;
# 5. the step of part 2 profiled (torch.profiler, after one step unprofiled): per phase, rollout and training, the
#    GPU's busy time (the union of its kernels and copies) against the gaps in which it waited on the host, and the
#    kernels with the most GPU time (profile_d20.json's profile_split, profile_d20.log);
# 6. the CUDA tests (`-m cuda`: NCCL under torchrun, bf16 vs fp32 step, a real out-of-memory, chat_sft and chat_eval
#    on CUDA, checkpoints across devices, CUDA-graph replay equal to the static step it captures, FlexAttention
#    compiled; their runs of the scripts pass --compile=off), but test_compile.py's (the compiled stage runs them)
#    and the kernels' (part 1b ran them);
# 7. the epoch estimate: scripts/bench_epoch.py times a d20 save both ways (written whole, and in the background)
#    and prints `d20 epoch on this GPU ≈ N min` from part 2's step, its rollout rate for the evals and the save
#    (epoch_d20.json);
# 8. the bench of part 2 with 16 trained rows a forward (train_rows_d20.json), against CUDA's auto 64;
# 9. the bench of part 2 with the host feeding the rows in step with the device (nolag_d20.json), against part 2's
#    host one step behind (the engine's lag, its default on CUDA): decode ms, tokens_digest equal to part 2's;
# 10. with the time left, the same bench with the static step compiled whole and captured (compiled_d20.json): compile
#    seconds, decode ms per step, the compiled training pass (tokens_digest in both JSONs, to compare with part 2's).
# kernels: part 1b, then (where it passed) part 2b and part 2 beside it: the Triton step checked, then timed.
# compiled: --compile=on on CUDA (auto compiles nothing there until this stage measures that it pays): the d20 bench
#    with the static step compiled by Inductor and captured in the engine's graphs (and the training forward
#    compiled), then the uncompiled graph config beside it (the JSON is written after each: a call stopped in the
#    second keeps the first), 2 consecutive steps each: compile seconds and graphs per step, decode ms per step
#    against the bound, tokens compared (compiled_d20.log with TORCH_LOGS=recompiles, compiled_d20.json); then, with
#    the time left, the compiled static step replayed from CUDA graphs against itself run without them
#    (tests/compiling/test_compile.py's cuda tests; they passed on an H200). Measurements first: on the first H100 run,
#    torch 2.11, the d20 step had not finished compiling after two minutes; on an H200 its first graph took 53 s (a
#    batch's shapes now make one graph, or two where Inductor guards the first on all the batch's rows and the second
#    comes from its cache), and beside checks with the tests first the bench found ~60 s (never its end).
# suite: the whole test suite on the GPU machine, the `cuda` tests run, not skipped: first those alone (but
#    test_compile's: the compiled stage's; gpu_suite_cuda.log), then the others on 8 workers (gpu_suite.log).
# speedrun: `bash speedrun.sh` on a fresh base dir (the bootstrap path), timed, with its report (speedrun.log,
#    speedrun_report.md): the target is under 5 minutes with pass@1 up by at least 4 standard errors.
# env: only the setup below; says which python runs and what was installed.
# Every stage: OUT_DIR/summary.md (tests/gpu_summary.py, remade after each part), the figures so far on one page: the
# GPU, torch, the commit (GPU_CHECK_COMMIT, else git's), each part's exit and seconds, each bench configuration's
# decode, rollout, training and step times, compiles and captures, the d20 step against issue 57's targets, the
# epoch, the profile's split and whether FlexAttention compiled.
#
# Setup, before every stage: the python is $PYTHON, else the first of python3, python3.12, python3.11, python3.10,
# python that is >= 3.10 and whose torch sees CUDA. If it has everything in tests/gpu_requirements.txt it runs as it
# is; else a venv over it (.gpu_venv, tests/gpu_venv.sh: it sees the python's own packages, a venv's too; made
# without pip, so no ensurepip is needed) gets what it lacks from gpu_carry/wheels, with the python's own pip or
# else the pip wheel carried there (wandb only for the suite, which alone needs it). The venv sits outside gpu_carry,
# which each device call replaces, and is reused while its stamp (the python, its version, the wheels) matches:
# nothing is installed twice on a machine.
# With gpu_carry/ present, NANOCHAT_BASE_DIR defaults to gpu_carry/base (its tokenizer has nanochat's 65,536 tokens,
# which the d20 preset needs), NANOCHAT_GSM8K_DIR to gpu_carry/gsm8k, and the datasets stand-in goes on PYTHONPATH
# (not for the suite). Results go to OUT_DIR (default ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-checks}
out=${2:-out}
IFS=, read -r -a stages <<< "$stage"
for s in "${stages[@]}"; do
    case "$s" in checks|kernels|compiled|suite|speedrun|env) ;; *) echo "gpu_check: unknown stage $s; use checks, kernels, compiled, suite, speedrun or env (or several, comma-separated)" >&2; exit 2 ;; esac
done
case "$out" in checks|kernels|compiled|suite|speedrun|env) echo "gpu_check: '$out' is a stage, not an output folder; name several stages with commas: $stage,$out" >&2; exit 2 ;; esac
mkdir -p "$out"
rm -f "$out/parts.jsonl" "$out/results.tgz"  # this call's parts only
export PYTHONUNBUFFERED=1
stage_start=$(date +%s)
# the whole invocation's seconds, setup included: one stage under the 8 minutes it may take; several (one call of
# a 15-minute device budget: checks,compiled) under 9.5 (a device call may take 10), shared out as the stages
# start (see below)
STAGE_SECONDS=${GPU_CHECK_STAGE_SECONDS:-$([ ${#stages[@]} -gt 1 ] && echo 560 || echo 470)}
end_of_all=$((stage_start + STAGE_SECONDS))
deadline=$end_of_all
say() { echo "gpu_check: $*"; }
# shellcheck source=tests/gpu_venv.sh
source tests/gpu_venv.sh
# a probe of the GPU that does not answer in this many seconds means a wedged GPU or driver: say so, do not hang
# (a call on the first GPU machine printed nothing after the setup's first line until its limit, cause unknown)
PROBE_SECONDS=${GPU_CHECK_PROBE_SECONDS:-120}

# ---- setup: a python >= 3.10 with a CUDA torch, and what tests/gpu_requirements.txt names
cuda_python() {  # prints the path of the first candidate python that is >= 3.10 and whose torch sees CUDA
    local candidates=(python3 python3.12 python3.11 python3.10 python)
    [ -n "${PYTHON:-}" ] && candidates=("$PYTHON")
    for p in "${candidates[@]}"; do
        command -v "$p" >/dev/null 2>&1 || continue
        if timeout --kill-after=5 "$PROBE_SECONDS" "$p" -c \
            "import sys, torch; sys.exit(0 if sys.version_info >= (3, 10) and torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
            command -v "$p"
            return 0
        fi
    done
    return 1
}
python=$(cuda_python) || {
    say "no python >= 3.10 whose torch sees a CUDA GPU (tried ${PYTHON:-python3 python3.12 python3.11 python3.10 python}); set PYTHON to one"
    exit 2
}
pyver=$("$python" -c "import sys; print('%d.%d' % sys.version_info[:2])")
suite_flag=$([[ ",$stage," == *,suite,* ]] && echo --suite)  # wandb: only the suite needs it
unmet() { "$1" tests/gpu_requirements.py $suite_flag tests/gpu_requirements.txt; }
missing=$(unmet "$python")
if [ -n "$missing" ]; then
    venv=$PWD/.gpu_venv
    wheels=$PWD/gpu_carry/wheels
    # "bridged": made by make_venv_over (a venv of an earlier gpu_check could not see a venv python's packages)
    stamp="bridged $python $pyver $(ls "$wheels" 2>/dev/null | md5sum | cut -c1-12)"
    if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/stamp" 2>/dev/null)" = "$stamp" ]; then
        missing=$(unmet "$venv/bin/python")  # what an earlier stage did not need
        say "reusing $venv (python $pyver)${missing:+; it lacks $(echo $missing)}"
    else
        make_venv_over "$python" "$venv" || { say "could not make a venv over $python at $venv"; exit 2; }
        echo "$stamp" > "$venv/stamp"
        say "made $venv over python $pyver at $python (its packages stay visible); it lacks $(echo $missing)"
    fi
    if [ -n "$missing" ]; then
        [ -d "$wheels" ] || { say "there is no gpu_carry/wheels to install $(echo $missing) from; run tests/gpu_prepare.sh and carry gpu_carry"; exit 2; }
        t0=$(date +%s)
        if "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
            pip=("$venv/bin/python" -m pip)
        else
            pip_wheel=$(ls "$wheels"/pip-*.whl 2>/dev/null | tail -1)
            [ -n "$pip_wheel" ] || { say "python $pyver has no pip and gpu_carry/wheels no pip wheel; run tests/gpu_prepare.sh again"; exit 2; }
            pip=("$venv/bin/python" "$pip_wheel/pip")  # pip runs from its own wheel
        fi
        mapfile -t wanted <<< "$missing"
        if ! "${pip[@]}" install --quiet --no-index --find-links "$wheels" --no-warn-script-location "${wanted[@]}"; then
            say "could not install $(echo $missing) for python $pyver from gpu_carry/wheels; run tests/gpu_prepare.sh SHARED_DIR $pyver (GPU_EXTRA=\"numpy matplotlib\" for those, SUITE_PYTHON=$pyver for wandb)"
            exit 2
        fi
        still=$(unmet "$venv/bin/python")
        [ -z "$still" ] || { say "after installing, python $pyver still lacks $(echo $still)"; exit 2; }
        say "installed $(echo $missing) into $venv in $(( $(date +%s) - t0 )) s"
    fi
    python=$venv/bin/python
else
    say "python $pyver at $python has every requirement of this stage; no venv"
fi
# `python` on PATH for speedrun.sh and the tests' subprocesses: the one chosen here
bin=$PWD/.gpu_bin
mkdir -p "$bin"
python_wrapper "$python" "$bin/python"  # not a symlink: see tests/gpu_venv.sh
export PATH="$bin:$PATH"
if [ -d gpu_carry ]; then
    export NANOCHAT_BASE_DIR=${NANOCHAT_BASE_DIR:-$PWD/gpu_carry/base}
    export NANOCHAT_GSM8K_DIR=${NANOCHAT_GSM8K_DIR:-$PWD/gpu_carry/gsm8k}
fi
timeout --kill-after=5 "$PROBE_SECONDS" "$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || {
    say "torch could not name the GPU within $PROBE_SECONDS s (exit $?; 124: it hung)"; exit 2; }
timeout 30 nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee "$out/gpu.txt"
# the commit measured, for the summary: GPU_CHECK_COMMIT where the device's copy of the tree has no .git
echo "${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$out/commit.txt"
say "setup took $(( $(date +%s) - stage_start )) s"
printf '{"part": "setup", "exit": 0, "seconds": %d, "python": "%s"}\n' "$(( $(date +%s) - stage_start ))" "$python" \
    >> "$out/parts.jsonl"

# every file of OUT_DIR in one archive, remade after each part: a device call brings back at most 8 files
# (written outside OUT_DIR first: tar archiving the folder it writes into can fail, "file changed as we read it")
bundle() {
    local archive
    "$python" tests/gpu_summary.py "$out" > /dev/null 2>&1  # summary.md: the figures so far on one page
    archive=$(mktemp) && tar czf "$archive" --exclude=results.tgz -C "$out" . && mv "$archive" "$out/results.tgz"
}
trap bundle EXIT  # the last part's files too (the speedrun's report), and the setup's when it stops the call

# ---- the stage's steps, each under a timeout that keeps the stage inside STAGE_SECONDS
step() {  # step NAME MAX_SECONDS LOG CMD...: runs CMD under a timeout (at most MAX_SECONDS, and what is left of the stage)
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((deadline - $(date +%s)))
    if [ "$left" -le 10 ]; then
        say "$name: not run, the stage's time is spent"
        return 124
    fi
    [ "$cap" -lt "$left" ] || cap=$left
    local t0
    t0=$(date +%s)
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "$name: stopped at its $cap s limit after $took s (exit $rc)" | tee -a "$log"
    else
        say "$name: exit $rc in $took s" | tee -a "$log"
    fi
    printf '{"part": "%s", "exit": %d, "seconds": %d, "limit": %d, "log": "%s"}\n' \
        "$name" "$rc" "$took" "$cap" "$(basename "$log")" >> "$out/parts.jsonl"
    bundle
    return "$rc"
}

kernel_checks() {  # part 1b: the Triton kernels against their torch references, compiled here (tests/kernel_checks.py)
    step "kernel checks" 150 "$out/kernel_checks.log" "$python" tests/kernel_checks.py cuda "$out"
    local rc=$?
    "$python" tests/kernel_checks.py --note "$out"  # the part's line in parts.jsonl names the op that disagreed
    bundle
    return "$rc"
}

triton_bench() {  # triton_bench KERNEL_CHECKS_EXIT: part 2b, the d20 bench of the Triton step, where its kernels passed
    if [ "$1" -ne 0 ]; then
        say "d20 triton: not run, the kernel checks failed (exit $1): its timing would be of kernels that disagree"
        printf '{"part": "d20 triton", "exit": "not run: the kernel checks failed", "seconds": 0}\n' \
            >> "$out/parts.jsonl"
        bundle
        return 1
    fi
    # the step in the project's Triton kernels (issue 66; nanochat/kernels/: 10 kernels a block): decode ms, its
    # first call's Triton JIT in the captures' seconds, its tokens_digest beside part 2's; decides the engine's default
    step "d20 triton" 150 "$out/triton_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph_triton \
        --early-stop-mean=0 --no-signal-fractions= --repeat=3 --force-advantages --output="$out/triton_d20.json"
}

run_stage() {  # run_stage STAGE: its steps, under $deadline
case "$1" in
env)
    return 0
    ;;
checks)
    # the parts in the order of what they decide, the measurements first (on the fourth GPU run, an H200, the CUDA
    # tests first took 140 s and the parts after the epoch estimate found no time left): the d20 step, then what is
    # not yet decided from a GPU's figures (--compile=blocks, FlexAttention), where the step's time goes, the CUDA
    # tests (not test_compile's: the compiled stage runs those), the epoch (from part 2's step and a timed save),
    # then what is already decided (16 rows a forward, no lag) and the compiled step. The Triton kernels' correctness
    # before all of them: a timing of kernels that compute the wrong thing decides nothing
    kernel_checks
    kernels_rc=$?
    step "d20 bench" 150 "$out/bench_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph \
        --early-stop-mean=0 --no-signal-fractions= --repeat=3 --force-advantages --output="$out/bench_d20.json"
    bench_rc=$?
    triton_bench "$kernels_rc"
    # --compile=blocks (each block compiled around its attention, one compile for every layer; issue 48): whether
    # it pays on a GPU, and its compile seconds
    step "d20 blocks" 180 "$out/blocks_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph_blocks \
        --early-stop-mean=0 --no-signal-fractions= --repeat=2 --force-advantages --output="$out/blocks_d20.json"
    # FlexAttention for the shared-prompt attention, compiled alone (issue 57): decode ms against part 2's
    step "d20 flex" 120 "$out/flex_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph_flex \
        --early-stop-mean=0 --no-signal-fractions= --repeat=2 --force-advantages --output="$out/flex_d20.json"
    # where part 2's step goes: the GPU busy (kernels and copies) against its waits on the host (launch gaps), per phase
    step "d20 profile" 100 "$out/profile_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph --profile=batched_bf16_graph \
        --early-stop-mean=0 --no-signal-fractions= --repeat=1 --force-advantages --output="$out/profile_d20.json"
    step "cuda tests" 200 "$out/cuda_tests.log" "$python" -m pytest -q -p no:cacheprovider -rs --durations=10 -m cuda \
        --ignore=tests/compiling/test_compile.py --ignore=tests/kernels/test_triton_kernels.py \
        --ignore=tests/kernels/test_kernel_rollouts.py tests
    tests_rc=$?
    step "epoch estimate" 60 "$out/epoch_d20.log" \
        "$python" -m scripts.bench_epoch --bench="$out/bench_d20.json" --device-type=cuda --output="$out/epoch_d20.json"
    # 16 trained rows a forward (the CPU's auto) against CUDA's auto 64 (part 2; an H200: 2.49 s against 1.36 s)
    step "d20 16 train rows" 75 "$out/train_rows_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph --train-rows=16 \
        --early-stop-mean=0 --no-signal-fractions= --repeat=2 --force-advantages --output="$out/train_rows_d20.json"
    # the host in step with the device (issue 49's lag off): what lagging gains (an H200: 7.24 ms a decode step
    # against 6.28-6.40 with the lag)
    step "d20 no lag" 60 "$out/nolag_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph_nolag \
        --early-stop-mean=0 --no-signal-fractions= --repeat=2 --force-advantages --output="$out/nolag_d20.json"
    # last, with what is left: on an H200 the whole d20 step's first graph took 53 s to compile
    step "d20 compiled" 300 "$out/compiled_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph_compiled \
        --early-stop-mean=0 --no-signal-fractions= --repeat=2 --force-advantages --output="$out/compiled_d20.json"
    say "checks: kernel checks exit $kernels_rc, tests exit $tests_rc, bench exit $bench_rc," \
        "$(( $(date +%s) - stage_start )) s since the setup began"
    [ "$kernels_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
    ;;
kernels)
    kernel_checks
    kernels_rc=$?
    triton_bench "$kernels_rc"
    triton_rc=$?
    step "d20 bench" 150 "$out/bench_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph \
        --early-stop-mean=0 --no-signal-fractions= --repeat=3 --force-advantages --output="$out/bench_d20.json"
    bench_rc=$?
    [ "$kernels_rc" -eq 0 ] && [ "$triton_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
    ;;
compiled)
    # the d20 bench first, each compile and recompile named as it happens; then the compiled step captured in CUDA
    # graphs against itself without them (a tiny model)
    TORCH_LOGS=recompiles step "d20 compiled bench" 600 "$out/compiled_d20.log" \
        "$python" -m scripts.bench_rl --preset=d20 --device-type=cuda --configs=batched_bf16_graph_compiled,batched_bf16_graph \
        --early-stop-mean=0 --no-signal-fractions= --repeat=2 --force-advantages --output="$out/compiled_d20.json"
    compiled_rc=$?
    step "compiled gpu tests" 200 "$out/compiled_tests.log" \
        "$python" -m pytest -q -p no:cacheprovider -rs -m cuda tests/compiling/test_compile.py
    tests_rc=$?
    [ "$tests_rc" -eq 0 ] && [ "$compiled_rc" -eq 0 ]
    ;;
suite)
    # first the cuda tests, one at a time (one of them takes all of the GPU's memory but 160 MB; test_compile's are the
    # compiled stage's), then the tests that leave the GPU alone on 8 of the machine's 16 cores (~12 minutes on one
    # 2-core CPU), with the time left
    step "suite, cuda tests" 200 "$out/gpu_suite_cuda.log" "$python" -m pytest -q -p no:cacheprovider -rs -m cuda \
        --ignore=tests/compiling/test_compile.py tests
    cuda_rc=$?
    step "suite" 420 "$out/gpu_suite.log" "$python" -m pytest -q -p no:cacheprovider -rs --durations=20 \
        -n 8 --dist loadfile -m "not cuda" tests
    suite_rc=$?
    [ "$cuda_rc" -eq 0 ] && [ "$suite_rc" -eq 0 ]
    ;;
speedrun)
    base=$(mktemp -d)
    NANOCHAT_BASE_DIR=$base SPEEDRUN_SKIP_INSTALL=1 step "speedrun" 600 "$out/speedrun.log" bash speedrun.sh
    rc=$?
    cp "$base/report/report.md" "$out/speedrun_report.md" 2>/dev/null
    return "$rc"
    ;;
esac
}

# Each stage gets its weight's share of the seconds left when it starts (what one leaves unused goes to the next;
# on the H200, checks took 3 minutes with 4 of its tests failing early), and runs in a subshell, so that its environment stays its own. The exit
# status is the first failing stage's (124 or 137: it ran out of time).
weight() { case "$1" in checks) echo 6 ;; kernels|compiled) echo 4 ;; suite|speedrun) echo 6 ;; env) echo 1 ;; esac; }
status=0
for i in "${!stages[@]}"; do
    now=$(date +%s)
    weights_left=0
    for s in "${stages[@]:i}"; do weights_left=$((weights_left + $(weight "$s"))); done
    deadline=$(( now + (end_of_all - now) * $(weight "${stages[i]}") / weights_left ))
    [ ${#stages[@]} -eq 1 ] || say "stage ${stages[i]}: up to $((deadline - now)) s"
    (
        # the json-only `datasets` stand-in for the scripts (they never import it with a local GSM8K directory);
        # the suite goes without it: test_gsm8k compares the local order with the real datasets' shuffle where
        # installed
        if [ -d gpu_carry ] && [ "${stages[i]}" != suite ]; then
            export PYTHONPATH="$PWD/gpu_carry/offline${PYTHONPATH:+:$PYTHONPATH}"
        fi
        run_stage "${stages[i]}"
    ) || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
done
exit "$status"
