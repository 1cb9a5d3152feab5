"""
The Triton kernels' correctness part of gpu_check.sh (its `checks` and `kernels` stages run it before any timing of
the Triton step): each kernel op against its torch reference on the tests' hand-made states and a whole fp32 rollout
against the torch step (tests/kernels/test_triton_kernels.py, test_kernel_rollouts.py), on one target, with a verdict
per op. Writes OUT_DIR/kernel_checks.json (the target, tests passed/failed/skipped, the ops that disagreed and their
failing tests: tests/gpu_summary.py puts it on the summary's page) and prints one line; exits 0 when every test of
the target ran and passed, 1 when an op disagreed or none ran, 2 on a usage error.

    python tests/kernel_checks.py cuda OUT_DIR                  # on a GPU: compiled (the tests marked cuda)
    python tests/kernel_checks.py interpreter OUT_DIR [-k EXPR]  # on a CPU: in Triton's interpreter (for its tests)
    python tests/kernel_checks.py --note OUT_DIR                 # the verdict into the part's line of parts.jsonl
"""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILES = ("tests/kernels/test_triton_kernels.py", "tests/kernels/test_kernel_rollouts.py")
# target -> the pytest selection of its tests' parameters (kernel_targets.TARGETS' ids and marks)
SELECTION = {"cuda": ["-m", "cuda"], "interpreter": ["-m", "not cuda and not slow", "-k", "interpreter"]}
# the op a test checks, by the first of these its name holds
OPS = (("prompt_attention", "prompt_attention"), ("rotary_store", "rotary_store"), ("residual_norm", "residual_norm"),
       ("relu_square", "relu_square"), ("sample_rows", "sample_rows"), ("rollouts", "the decode step (rollouts)"))


def op_of(test_name):
    return next((op for key, op in OPS if key in test_name), "other")


def read_junit(path):
    """(passed, skipped, {op: [failing test names]}) from pytest's junit XML."""
    passed, skipped, failed = 0, 0, {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed.setdefault(op_of(case.get("name")), []).append(case.get("name"))
        elif "skipped" in outcome:
            skipped += 1
        else:
            passed += 1
    return passed, skipped, failed


def verdict(result):
    """The one line the part prints and the summary repeats."""
    if result["failed"]:
        ops = ", ".join(f"{op} ({len(tests)} test{'s' * (len(tests) > 1)})" for op, tests in result["failed"].items())
        return f"kernel checks on {result['target']}: FAILED: {ops} disagree with their torch references"
    if result["passed"] == 0:
        return f"kernel checks on {result['target']}: FAILED: no test ran (pytest exit {result['exit']})"
    return f"kernel checks on {result['target']}: {result['passed']} tests passed, every op agrees"


def note_verdict(out):
    """Add the verdict (or why there is none) to the last "kernel checks" line of OUT_DIR/parts.jsonl, which
    gpu_check.sh's step wrote: the part's line then names the op that disagreed."""
    try:
        with open(os.path.join(out, "kernel_checks.json")) as f:
            note = json.load(f)["verdict"]
    except (OSError, ValueError, KeyError):
        note = "no verdict: the part stopped before writing kernel_checks.json"
    path = os.path.join(out, "parts.jsonl")
    with open(path) as f:
        parts = [json.loads(line) for line in f if line.strip()]
    last = max((i for i, part in enumerate(parts) if part.get("part") == "kernel checks"), default=None)
    if last is not None:
        parts[last]["verdict"] = note
    with open(path, "w") as f:
        f.writelines(json.dumps(part) + "\n" for part in parts)
    return 0


def main(argv):
    if len(argv) == 2 and argv[0] == "--note":
        return note_verdict(argv[1])
    if len(argv) < 2 or argv[0] not in SELECTION or (len(argv) > 2 and (argv[2] != "-k" or len(argv) != 4)):
        print("usage: python tests/kernel_checks.py cuda|interpreter OUT_DIR [-k EXPR] | --note OUT_DIR",
              file=sys.stderr)
        return 2
    target, out = argv[0], argv[1]
    os.makedirs(out, exist_ok=True)
    selection = list(SELECTION[target])
    if len(argv) == 4:  # a narrower selection (the tests of this part), within the target's
        selection = selection[:-1] + [f"{selection[-1]} and ({argv[3]})"] if "-k" in selection \
            else selection + ["-k", argv[3]]
    junit = os.path.join(out, "kernel_checks.xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *selection,
               f"--junitxml={junit}", *TEST_FILES]
    done = subprocess.run(command, cwd=REPO)
    passed, skipped, failed = read_junit(junit) if os.path.exists(junit) else (0, 0, {})
    result = {"target": target, "exit": done.returncode, "passed": passed, "skipped": skipped, "failed": failed}
    result["verdict"] = verdict(result)
    with open(os.path.join(out, "kernel_checks.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(result["verdict"])
    return 0 if done.returncode == 0 and passed > 0 and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
