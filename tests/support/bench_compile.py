"""
The compile benchmark (run by hand, not by pytest): chat_rl's speedrun workload end to end with --compile=off, auto and
on, on a cold Inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR), on again warm (the cache its cold run filled), and auto
in on's warm cache (whose ledger on wrote), compiling included; one JSON on stdout. From the same runs, the seconds of a
467-step run (a GSM8K epoch's length) are estimated for each mode: the run's wall time plus 367 more steady steps.

    python tests/support/bench_compile.py --base-dir=$NANOCHAT_BASE_DIR > compile_bench.json   # a speedrun's SFT model there

Each run is a process of its own, one at a time (two at once on 2 cores slow each other ~10x).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

# the speedrun's RL stage on a CPU (speedrun.sh)
SPEEDRUN_RL = ["--run=dummy", "--task=arithmetic", "--device-type=cpu", "--examples-per-step=16", "--num-samples=8",
               "--device-batch-size=8", "--max-new-tokens=128", "--eval-every=50", "--eval-examples=100",
               "--save-every=-1", "--overwrite", "--output-tag=bench_compile"]
# mode:cache, cache = cold (a fresh one), warm (the same mode's cold run's) or another mode (its cold run's): auto in
# on's cache finds the graphs there, and their cost in the ledger beside them
RUNS = [("off", "cold"), ("auto", "cold"), ("on", "cold"), ("on", "warm"), ("auto", "on")]
EPOCH_STEPS = 467


def run(mode, cache_dir, base_dir, steps):
    """One chat_rl run: its wall seconds and its history (the last checkpoint's meta)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "NANOCHAT_BASE_DIR": base_dir}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "scripts.chat_rl", *SPEEDRUN_RL, f"--num-steps={steps}",
                          f"--compile={mode}"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"chat_rl --compile={mode} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    meta_path = os.path.join(base_dir, "chatrl_checkpoints", "bench_compile", f"meta_{steps - 1:06d}.json")
    with open(meta_path) as f:
        meta = json.load(f)
    return wall, meta, [line for line in out.stdout.splitlines() if line.startswith("compile")]


def summary(wall, meta, lines, steps):
    history = meta["history"]
    compile_s = sum(r.get("compile_s", 0.0) for r in history)  # an eval's compiling is in wall_s, not here
    steady = [r["time/rollout"] + r["time/train"] - r.get("compile_s", 0.0) for r in history[3:]]
    step_s = statistics.median(steady)
    steps_s = sum(r["time/rollout"] + r["time/train"] for r in history)
    outside = wall - steps_s  # start-up (loading, dtype timing), evals, the report
    return {"wall_s": round(wall, 1), "compiles": int(sum(r.get("compiles", 0) for r in history)),
            "compile_s_in_steps": round(compile_s, 1), "steady_step_s": round(step_s, 3),
            "train_s": round(statistics.median(r["time/train"] for r in history[3:]), 3),
            "rollout_s": round(statistics.median(r["time/rollout"] for r in history[3:]), 3),
            "outside_steps_s": round(outside, 1), "auto": meta.get("compile_auto"),
            f"estimate_{EPOCH_STEPS}_steps_s": round(wall + (EPOCH_STEPS - steps) * step_s, 1),
            "compile_lines": lines}


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--base-dir", default=os.environ.get("NANOCHAT_BASE_DIR"), help="holds the SFT model (a speedrun's)")
    p.add_argument("--num-steps", type=int, default=100, help="the speedrun's RL steps")
    p.add_argument("--runs", default=",".join(f"{m}:{c}" for m, c in RUNS), help="mode:cold|warm, in order")
    args = p.parse_args()
    caches = {}  # mode -> the cache its cold run filled
    results = {"torch": torch.__version__, "cpu": _cpu(), "steps": args.num_steps, "runs": []}
    for spec in args.runs.split(","):
        mode, temperature = spec.split(":")
        if temperature == "cold":
            caches[mode] = tempfile.mkdtemp(prefix=f"inductor_{mode}_")
        cache = caches[mode if temperature in ("cold", "warm") else temperature]
        wall, meta, lines = run(mode, cache, args.base_dir, args.num_steps)
        entry = {"compile": mode, "cache": temperature, **summary(wall, meta, lines, args.num_steps)}
        results["runs"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "compile_lines"}), file=sys.stderr, flush=True)
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(results, indent=1))


def _cpu():
    from nanochat.runtime.cpu_features import cpu_summary
    return cpu_summary()


if __name__ == "__main__":
    main()
