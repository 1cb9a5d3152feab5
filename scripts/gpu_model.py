"""
The model of one d20 decode step's GPU time, kernel by kernel (nanochat/diagnostics/gpu_model.py): the hand-written
torch step and the Triton step (its attention in one kernel, and split), on an H200 and an H100, calibrated on what
was measured there; no GPU needed (the work is recorded on the meta device). About 10 s on a CPU.

    python -m scripts.gpu_model              # a 256-token rollout's mean step
    python -m scripts.gpu_model --keys=256   # one step at 256 completion keys
"""

from nanochat.cli import ArgumentParser, add_debug_flag, run_main
from nanochat.diagnostics.gpu_model import print_model


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--keys", type=int, default=0, help="one step at this many completion keys (0: a rollout's mean)")
    p.add_argument("--calibrate", action="store_true", help="print the kernel cost that fits the H200's figure")
    add_debug_flag(p)
    args = p.parse_args(argv)
    print_model(args.keys, args.calibrate)


if __name__ == "__main__":
    run_main(main)
