"""Prints docs/performance.md's table of the Triton decode step's sm_90 binaries (nanochat/diagnostics/kernel_binary.py:
each kernel as the engine's d20 calls bind it, compiled by Triton and assembled by its ptxas without a GPU) and exits 1
where one spills registers. `python tests/support/sm90_compile.py [DIR]`: with DIR, the triton installed there
(`pip install --target DIR --no-deps triton==3.6.0`, the GPU image's) compiles instead of this environment's."""

import sys

from nanochat.diagnostics.kernel_binary import RECORDED_LAYERS, kernel_binaries, markdown_table

if __name__ == "__main__":
    binaries = kernel_binaries(sys.argv[1] if len(sys.argv) > 1 else None)
    print(f"triton {binaries[0]['triton']}, sm_90, {RECORDED_LAYERS} recorded layers of d20")
    print(markdown_table(binaries))
    sys.exit(1 if any(b["spill_bytes"] for b in binaries) else 0)
