"""The lines of tests/gpu_requirements.txt that this python does not meet (missing, or older than the line's
>=version), one a line on stdout; lines marked "# suite" only with --suite. --list prints the requirements without
checking them (--suite-only: only the suite's own). Standard library only: it runs before anything is installed.
Used by tests/gpu_check.sh and tests/gpu_prepare.sh.

    python tests/gpu_requirements.py [--suite] [--list [--suite-only]] tests/gpu_requirements.txt
"""

import importlib.metadata
import re
import sys


def version_tuple(text):
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def requirements(lines, suite):
    for line in lines:
        requirement, _, comment = line.partition("#")
        if requirement.strip() and (suite or comment.strip() != "suite"):
            yield requirement.strip()


def unmet(requirement):
    name, _, minimum = requirement.partition(">=")
    try:
        have = importlib.metadata.version(name.strip())
    except importlib.metadata.PackageNotFoundError:
        return True
    return bool(minimum) and version_tuple(have) < version_tuple(minimum)


if __name__ == "__main__":
    flags = set(a for a in sys.argv[1:] if a.startswith("--"))
    with open(next(a for a in sys.argv[1:] if not a.startswith("--"))) as f:
        lines = f.readlines()
    chosen = list(requirements(lines, suite=bool(flags & {"--suite", "--suite-only"})))
    if "--suite-only" in flags:
        chosen = [r for r in chosen if r not in set(requirements(lines, suite=False))]
    print("\n".join(chosen if "--list" in flags else [r for r in chosen if unmet(r)]))
