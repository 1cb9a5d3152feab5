"""
The learning check of the algorithm options at CPU size: chat_rl on the speedrun's arithmetic workload with
nanochat's defaults and with variants, one run after another from the same SFT checkpoint, then compare_runs.

  1. for each variant: python -m scripts.chat_rl with the speedrun's CPU RL flags (16 questions x 8 samples,
     128 new tokens, nanochat's learning rates), fewer steps, and the variant's flags, written to
     chatrl_checkpoints/<variant>; pass@1 on --eval-examples held-out questions at step 0, every
     --eval-every steps and after the last step;
  2. python -m scripts.compare_runs over the runs: one PNG (reward, pass@1, length, entropy) and a table;
  3. a markdown table (printed, and report/rl_variants.md): each run's sampled pass@1 (the mean over a question's
     samples) at every eval with its standard error, at most sqrt(p (1 - p) / Q) over Q questions, and its mean
     seconds a step (rollouts + training, and the teacher's forwards within them).

On-policy distillation (issue 75) side by side with RL alone: the variants `distill` (--teacher, --distill-coef,
--reward-coef=0: distillation alone) and `rl_distill` (the reward and the teacher), taught by --teacher (e.g. the
speedrun's RL checkpoint), against `default` (RL alone), the same seeds (docs/flags.md, "On-policy distillation").

Needs an SFT checkpoint in $NANOCHAT_BASE_DIR (speedrun.sh's bootstrap makes one; the distillation variants, its
RL checkpoint too). Runs in sequence, each in its own process.

Launch:
  python -m scripts.rl_variants                                  # the algorithm variants, 50 steps each
  python -m scripts.rl_variants --variants=default,token_ppo --steps=30 --eval-examples=100
  python -m scripts.rl_variants --variants=default,distill,rl_distill --steps=100 --eval-examples=100
"""

import json
import math
import os
import subprocess
import sys
import time

from nanochat.checkpoints.layout import meta_path
from nanochat.checkpoints.store import find_last_step
from nanochat.cli import ArgumentParser, add_debug_flag, add_shared_flag, run_main
from nanochat.common import get_base_dir
from nanochat.errors import UserError

# the speedrun's CPU RL configuration (speedrun.sh), without its step count and evals; in fp32, so that every run
# has the same numerics (a bf16 CPU run picks its rollout dtype by timing both, which can differ from run to run)
WORKLOAD = ["--task=arithmetic", "--examples-per-step=16", "--num-samples=8", "--device-batch-size=8",
            "--max-new-tokens=128", "--save-every=-1", "--overwrite", "--dtype=float32"]
VARIANTS = {
    "default": [],                                                                  # nanochat
    "token_ppo": ["--loss-norm=token", "--clip-high=0.28", "--ppo-epochs=2"],       # DAPO-style
    "grpo_kl": ["--loss-norm=sequence", "--advantage-std", "--kl-coef=0.01"],       # GRPO (DeepSeekMath)
    "drgrpo": ["--loss-norm=constant", "--mask-truncated"],                         # Dr. GRPO + overlong filtering
    # on-policy distillation from --teacher (with --distill-coef): alone, and beside the reward
    "distill": ["--teacher={teacher}", "--distill-coef={distill_coef}", "--reward-coef=0"],
    "rl_distill": ["--teacher={teacher}", "--distill-coef={distill_coef}"],
}
DEFAULT_VARIANTS = ("default", "token_ppo", "grpo_kl", "drgrpo")


def build_parser():
    p = ArgumentParser(description="chat_rl with nanochat's defaults and algorithm variants, then compare_runs")
    p.add_argument("--variants", type=str, default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated names among {', '.join(VARIANTS)}")
    p.add_argument("--teacher", type=str, default="", help="the distillation variants' teacher, "
                   "SOURCE[:MODEL_TAG[:STEP]] (the speedrun's RL run on a CPU: rl:d4)")
    p.add_argument("--distill-coef", type=float, default=1.0, help="the distillation variants' --distill-coef")
    p.add_argument("--steps", type=int, default=50, help="RL steps per run")
    p.add_argument("--eval-every", type=int, default=25, help="pass@1 eval period (also step 0 and the last step)")
    p.add_argument("--eval-examples", type=int, default=200, help="held-out questions per eval")
    add_shared_flag(p, "device_type", script="rl_variants", help="cuda|cpu|mps")
    p.add_argument("--output", type=str, default=None,
                   help="the comparison PNG; default $NANOCHAT_BASE_DIR/report/rl_variants.png")
    add_debug_flag(p)  # passed on to the chat_rl runs
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def main(argv):
    args = parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise UserError(f"--variants: unknown {', '.join(unknown) or '(none given)'}; choose among {', '.join(VARIANTS)}")
    if args.steps < 1 or args.eval_every < 1 or args.eval_examples < 1:
        raise UserError("--steps, --eval-every and --eval-examples must be >= 1")
    taught = [n for n in names if any("{teacher}" in flag for flag in VARIANTS[n])]
    if taught and not args.teacher:  # named: "rl" alone would be the largest RL run, maybe one of these variants
        raise UserError(f"--variants {','.join(taught)} need a teacher: pass --teacher=SOURCE:MODEL_TAG (the "
                        f"speedrun's RL run on a CPU: --teacher=rl:d4)")
    runs = []
    for name in names:
        cmd = [sys.executable, "-m", "scripts.chat_rl", *WORKLOAD, f"--num-steps={args.steps}",
               f"--eval-every={args.eval_every}", f"--eval-examples={args.eval_examples}",
               f"--device-type={args.device_type}", f"--output-tag={name}",
               *(flag.format(teacher=args.teacher, distill_coef=args.distill_coef) for flag in VARIANTS[name]),
               *(["--debug"] if args.debug else [])]
        print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        if subprocess.run(cmd).returncode != 0:
            raise UserError(f"the {name} run failed (its output is above)")
        print(f"=== {name}: {time.time() - t0:.0f}s", flush=True)
        runs.append(os.path.join(get_base_dir(), "chatrl_checkpoints", name))
    output = args.output or os.path.join(get_base_dir(), "report", "rl_variants.png")
    if subprocess.run([sys.executable, "-m", "scripts.compare_runs", *runs, f"--output={output}"]).returncode != 0:
        raise UserError("compare_runs failed (its output is above)")
    text = pass_at_1_table(runs, args.eval_examples)
    print(text)
    with open(os.path.splitext(output)[0] + ".md", "w", encoding="utf-8") as f:
        f.write(text + "\n")


def pass_at_1_table(runs, questions):
    """Markdown: each run's (directory) sampled pass@1 +- its standard error at every eval of its last meta, and its
    mean seconds a step (rollouts + training; the teacher's within them, where it has one)."""
    metas = {}
    for run in runs:
        with open(meta_path(run, find_last_step(run)), encoding="utf-8") as f:
            metas[os.path.basename(run)] = json.load(f)
    steps = sorted({step for meta in metas.values() for step, _ in meta["eval_history"]})
    lines = ["| run | " + " | ".join(f"pass@1, step {s}" for s in steps) + " | s/step | teacher s/step |",
             "|---|" + "---|" * (len(steps) + 2)]
    for name, meta in metas.items():
        evals = dict(meta["eval_history"])
        cells = [f"{p:.3f} ± {math.sqrt(p * (1 - p) / questions):.3f}" if p is not None else ""
                 for p in (evals[s]["pass@1_unbiased"] if s in evals else None for s in steps)]
        history = meta["history"]
        mean = lambda key: sum(h.get(key, 0.0) for h in history) / max(len(history), 1)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean('time/rollout') + mean('time/train'):.2f} | "
                     f"{mean('time/teacher'):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
