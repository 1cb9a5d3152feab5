"""
A gpu_check.sh call's figures in one page (OUT_DIR/summary.md), as issue 57 asks for them: the machine (GPU, torch)
and the commit; each part's exit and seconds; the Triton kernels' correctness part (tests/kernel_checks.py: which op
disagreed with its torch reference, if one did: the Triton step's timings are then not to be trusted); per benchmark file and configuration the decode step against its
bandwidth bound, the rollout, the training pass, the step, compiles and captures, peak memory and the tokens'
digest; those of the d20 step (part 2) against the targets; the epoch estimate; where the step's time goes (the
profile); whether FlexAttention compiled. What a part did not write is said, not left out.

    python tests/gpu_summary.py OUT_DIR      # gpu_check.sh runs it after every part; it reads JSON only (no torch)
"""

import json
import os
import sys

# the benchmark files gpu_check.sh writes, in the order of its parts
BENCH_FILES = ("bench_d20.json", "blocks_d20.json", "flex_d20.json", "profile_d20.json", "train_rows_d20.json",
               "nolag_d20.json", "compiled_d20.json")
# issue 57's targets (an H100's): the d20 step's figures held against them
TARGETS = (("decode step", "decode_ms_per_step", 4.0, "ms"), ("rollout", "rollout_seconds", 1.2, "s"),
           ("training pass", "train_seconds", 1.0, "s"), ("step", "step_seconds", 2.5, "s"))
EPOCH_TARGET_MIN = 20.0
COMPILE_TARGET_S = 90.0
COLUMNS = (("decode ms", lambda r: r["decode_ms_per_step"], ".2f"),
           ("bound ms", lambda r: r["bandwidth_bound_ms"], ".2f"),
           ("rollout s", lambda r: r["rollout_seconds"], ".2f"),
           ("train s", lambda r: r["train_seconds"], ".2f"),
           ("step s", lambda r: r["step_seconds"], ".2f"),
           ("train MFU", lambda r: r["train_mfu"], ".1%"),
           ("compiles", lambda r: sum(r["compiles_each"]), "d"),
           ("compile s", lambda r: sum(r["compile_seconds_each"]), ".1f"),
           ("captures", lambda r: r["captures_each"][0], "d"),
           ("peak GB", lambda r: r["peak_memory_mb"] / 1024, ".1f"),
           ("tokens", lambda r: r["tokens_digest"], ""))


def read_json(path):
    """The file's JSON, or None where it is missing or unreadable (a part stopped before writing it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def last_line(path):
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None  # nvidia-smi's csv: a header, then the card


def table(header, rows):
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def cell(result, figure, spec):
    try:
        return format(figure(result), spec)
    except (KeyError, TypeError, IndexError):  # a figure this config has no value for
        return "-"


def summary(out):
    """summary.md's text for the gpu_check output folder `out`."""
    benches = {name: read_json(os.path.join(out, name)) for name in BENCH_FILES}
    machine = next((b["machine"] for b in benches.values() if b and b.get("machine")), {})
    commit = last_line(os.path.join(out, "commit.txt")) or "unknown"
    lines = ["# gpu_check summary", "",
             f"GPU: {last_line(os.path.join(out, 'gpu.txt')) or machine.get('gpu') or 'unknown'}; "
             f"torch {machine.get('torch', 'unknown')}; python {machine.get('python', 'unknown')}; commit {commit}", ""]
    parts = []
    try:
        with open(os.path.join(out, "parts.jsonl")) as f:
            parts = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        pass
    lines += ["## Parts", "", table(("part", "exit", "seconds", "limit"), [
        (p.get("part"), p.get("exit"), p.get("seconds"), p.get("limit", "-")) for p in parts]) if parts
        else "no part finished", ""]
    lines += kernel_checks_section(read_json(os.path.join(out, "kernel_checks.json")))
    rows, missing = [], []
    for name, bench in benches.items():
        if bench is None:
            missing.append(name)
            continue
        for config, result in bench.get("results", {}).items():
            rows.append((name + ("" if bench.get("complete", True) else " (incomplete)"), config)
                        + tuple(cell(result, figure, spec) for _, figure, spec in COLUMNS))
    lines += ["## Benchmarks", "", table(("file", "config") + tuple(h for h, _, _ in COLUMNS), rows) if rows
              else "no benchmark file", ""]
    if missing:
        lines += [f"Not written (the part did not run or did not finish): {', '.join(missing)}", ""]
    lines += targets_section(benches.get("bench_d20.json"), read_json(os.path.join(out, "epoch_d20.json")))
    lines += profile_section(benches.get("profile_d20.json")) + flex_section(benches.get("flex_d20.json"))
    return "\n".join(lines) + "\n"


def kernel_checks_section(checks):
    """tests/kernel_checks.py's verdict and, where an op disagreed, its failing tests."""
    if checks is None:
        return ["## Kernel checks", "", "not run (the Triton step's timings, if any, are unchecked)", ""]
    lines = ["## Kernel checks", "", checks["verdict"], ""]
    for op, tests in checks.get("failed", {}).items():
        lines.append(f"- {op}: {', '.join(tests)}")
    return lines + ([""] if checks.get("failed") else [])


def targets_section(bench, epoch):
    """The d20 step (part 2's config) against issue 57's targets, and the epoch estimate against its own."""
    result = next(iter((bench or {}).get("results", {}).values()), None)
    rows = [(what, cell(result, lambda r, k=key: r[k], ".2f") + f" {unit}", f"<= {target:g} {unit}",
             "yes" if result and key in result and result[key] <= target else "no")
            for what, key, target, unit in TARGETS] if result else []
    if result:  # the compiles (warm-up's included), and the captures: the first rollout's excess over the last
        once = sum(result["compile_seconds_each"]) + max(0.0, result["rollout_seconds_each"][0] - result["rollout_seconds"])
        rows.append(("compile + captures, once a run", f"{once:.1f} s", f"<= {COMPILE_TARGET_S:g} s",
                     "yes" if once <= COMPILE_TARGET_S else "no"))
    minutes = (epoch or {}).get("epoch", {}).get("minutes")
    if minutes is not None:
        rows.append(("d20 epoch estimate", f"{minutes:.1f} min", f"<= {EPOCH_TARGET_MIN:g} min",
                     "yes" if minutes <= EPOCH_TARGET_MIN else "no"))
    return ["## The d20 step against the targets (an H100's)", "",
            table(("", "measured", "target", "met"), rows) if rows else "no d20 step measured", ""]


def profile_section(bench):
    split = next(iter((bench or {}).get("profile_split", {}).values()), None)
    if not split:
        return []
    rows = [(phase, f"{p['wall_s']:.3f}", f"{p['gpu_busy_s']:.3f}", f"{p['gaps_s']:.3f}", p["gpu_ops"])
            for phase, p in split.items()]
    return ["## Where the step goes (profiled)", "", table(("phase", "wall s", "GPU busy s", "gaps s", "kernels"), rows), ""]


def flex_section(bench):
    states = [(config, r.get("flex_compile")) for config, r in (bench or {}).get("results", {}).items()]
    if not states:
        return []
    return ["## FlexAttention compiled", ""] + [
        f"- {config}: " + ("not compiled (not on CUDA)" if s is None else
                           f"{s['compiles']} graphs in {s['seconds']:.1f} s" if s["failed"] is None else
                           f"FAILED, the eager reference ran: {s['failed']}") for config, s in states] + [""]


def main(argv):
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python tests/gpu_summary.py OUT_DIR (gpu_check.sh's output folder)", file=sys.stderr)
        return 2
    text = summary(argv[0])
    with open(os.path.join(argv[0], "summary.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
