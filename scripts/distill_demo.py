"""
On-policy distillation shown side by side at CPU size (issue 75): the speedrun's RL checkpoint teaches its own SFT
starting point on arithmetic, against RL alone, with the same seeds.

  1. three chat_rl runs from the SFT checkpoint, each written to chatrl_checkpoints/distill_<variant>, with the
     speedrun's CPU RL workload in fp32 (16 questions x 8 samples, 128 new tokens, nanochat's learning rates):
       rl      --distill-coef=0 (RL alone: nanochat's run)
       distill --teacher=TEACHER --distill-coef=C --reward-coef=0 (distillation alone)
       both    --teacher=TEACHER --distill-coef=C (reward and teacher)
     sampled pass@1 on --eval-examples held-out questions at step 0 and every --eval-every steps (25, 50, ...,
     after the last step), the same questions and seeds in every run (the rollouts' seeds are the step's);
  2. a markdown table: sampled pass@1 (the mean over each question's 8 samples) with its standard error at
     most sqrt(p (1 - p) / Q) over Q questions, and the mean seconds a step (rollouts, training, the teacher's
     forwards within it).

Needs the speedrun's SFT and RL checkpoints in $NANOCHAT_BASE_DIR (speedrun.sh makes both). Runs in sequence.

Launch:
  python -m scripts.distill_demo                                   # 100 steps each, pass@1 every 25
  python -m scripts.distill_demo --teacher=rl:d4 --distill-coef=0.5 --steps=50 --variants=rl,both
"""

import json
import math
import os
import subprocess
import sys
import time

from nanochat.checkpoints.layout import meta_path
from nanochat.checkpoints.store import find_last_step
from nanochat.cli import ArgumentParser, add_shared_flag, run_main
from nanochat.common import get_base_dir
from nanochat.errors import UserError

# the speedrun's CPU RL configuration (speedrun.sh, as scripts/rl_variants.py runs it), in fp32 for the same numerics
WORKLOAD = ["--source=sft", "--task=arithmetic", "--examples-per-step=16", "--num-samples=8", "--device-batch-size=8",
            "--max-new-tokens=128", "--save-every=-1", "--overwrite", "--dtype=float32"]
VARIANTS = {
    "rl": lambda teacher, c: [],
    "distill": lambda teacher, c: [f"--teacher={teacher}", f"--distill-coef={c}", "--reward-coef=0"],
    "both": lambda teacher, c: [f"--teacher={teacher}", f"--distill-coef={c}"],
}


def build_parser():
    p = ArgumentParser(description="on-policy distillation against RL alone, side by side (issue 75)")
    p.add_argument("--teacher", type=str, default="rl", help="the teacher, SOURCE[:MODEL_TAG[:STEP]] (default: the "
                                                             "largest RL run's last step)")
    p.add_argument("--distill-coef", type=float, default=1.0, help="C of the distill and both variants")
    p.add_argument("--variants", type=str, default=",".join(VARIANTS), help=f"among {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=100, help="RL steps per run")
    p.add_argument("--eval-every", type=int, default=25, help="pass@1 eval period (also step 0 and the last step)")
    p.add_argument("--eval-examples", type=int, default=100, help="held-out questions per eval")
    add_shared_flag(p, "device_type", script="distill_demo", help="cuda|cpu|mps")
    p.add_argument("--output", type=str, default=None, help="the table's markdown file; default "
                                                           "$NANOCHAT_BASE_DIR/report/distill_demo.md")
    return p


def run_variant(name, args):
    """One chat_rl run of variant `name`; returns its directory."""
    tag = f"distill_{name}"
    cmd = [sys.executable, "-m", "scripts.chat_rl", *WORKLOAD, f"--num-steps={args.steps}",
           f"--eval-every={args.eval_every}", f"--eval-examples={args.eval_examples}",
           f"--device-type={args.device_type}", f"--output-tag={tag}", *VARIANTS[name](args.teacher, args.distill_coef)]
    print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    if subprocess.run(cmd).returncode != 0:
        raise UserError(f"the {name} run failed (its output is above)")
    print(f"=== {name}: {time.time() - t0:.0f}s", flush=True)
    return os.path.join(get_base_dir(), "chatrl_checkpoints", tag)


def table(results, questions):
    """The markdown table of {variant: its last meta}: pass@1 +- its standard error at each eval, seconds a step."""
    steps = sorted({step for meta in results.values() for step, _ in meta["eval_history"]})
    lines = ["| variant | " + " | ".join(f"pass@1 step {s}" for s in steps) + " | s/step (rollout + train) | "
             "teacher s/step |", "|---|" + "---|" * (len(steps) + 2)]
    for name, meta in results.items():
        evals = {step: d for step, d in meta["eval_history"]}
        cells = []
        for s in steps:
            p = evals[s]["pass@1_unbiased"] if s in evals else None
            cells.append("" if p is None else f"{p:.3f} ± {math.sqrt(p * (1 - p) / questions):.3f}")
        history = meta["history"]
        seconds = sum(h["time/rollout"] + h["time/train"] for h in history) / len(history)
        teacher = sum(h.get("time/teacher", 0.0) for h in history) / len(history)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {seconds:.2f} | {teacher:.2f} |")
    return "\n".join(lines)


def main(argv):
    args = build_parser().parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise UserError(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose among {', '.join(VARIANTS)}")
    if args.steps < 1 or args.eval_every < 1 or args.eval_examples < 1:
        raise UserError("--steps, --eval-every and --eval-examples must be >= 1")
    results = {}
    for name in names:
        run_dir = run_variant(name, args)
        with open(meta_path(run_dir, find_last_step(run_dir)), encoding="utf-8") as f:
            results[name] = json.load(f)
    text = table(results, args.eval_examples)
    print(text)
    output = args.output or os.path.join(get_base_dir(), "report", "distill_demo.md")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print(f"table: {output}")


if __name__ == "__main__":
    run_main(main)
