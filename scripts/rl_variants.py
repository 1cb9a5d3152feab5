"""
The learning check of the algorithm options at CPU size: chat_rl on the speedrun's arithmetic workload with
nanochat's defaults and with variants, one run after another from the same SFT checkpoint, then compare_runs.

  1. for each variant: python -m scripts.chat_rl with the speedrun's CPU RL flags (16 questions x 8 samples,
     128 new tokens, nanochat's learning rates), fewer steps, and the variant's flags, written to
     chatrl_checkpoints/<variant>; pass@1 on --eval-examples held-out questions at step 0, every
     --eval-every steps and after the last step;
  2. python -m scripts.compare_runs over the runs: one PNG (reward, pass@1, length, entropy) and a table.

Needs an SFT checkpoint in $NANOCHAT_BASE_DIR (speedrun.sh's bootstrap makes one). Runs in sequence, each
in its own process.

Launch:
  python -m scripts.rl_variants                                  # every variant below, 50 steps each
  python -m scripts.rl_variants --variants=default,token_ppo --steps=30 --eval-examples=100
"""

import os
import subprocess
import sys
import time

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
}


def build_parser():
    p = ArgumentParser(description="chat_rl with nanochat's defaults and algorithm variants, then compare_runs")
    p.add_argument("--variants", type=str, default=",".join(VARIANTS),
                   help=f"comma-separated names among {', '.join(VARIANTS)}")
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
    runs = []
    for name in names:
        cmd = [sys.executable, "-m", "scripts.chat_rl", *WORKLOAD, f"--num-steps={args.steps}",
               f"--eval-every={args.eval_every}", f"--eval-examples={args.eval_examples}",
               f"--device-type={args.device_type}", f"--output-tag={name}", *VARIANTS[name],
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


if __name__ == "__main__":
    run_main(main)
