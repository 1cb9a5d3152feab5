"""The shell scripts a CPU never runs (tests/gpu_check.sh, tests/gpu_prepare.sh; speedrun.sh runs in CI only as a
whole) name real things: every tests/ path they mention exists, every `-m scripts.X` is a script, and every bench
command of gpu_check.sh parses with the benchmark's own parser (its flags and --configs names exist), so that a
renamed test file or flag fails here, not in a GPU's scarce minutes."""

import re
import shlex
from pathlib import Path

import pytest

from helpers import REPO

SCRIPTS = sorted([*Path(REPO, "tests").glob("*.sh"), Path(REPO, "speedrun.sh")])


def commands(path):
    """The script's lines with backslash continuations joined."""
    return Path(path).read_text().replace("\\\n", " ").splitlines()


def test_every_tests_path_the_scripts_name_exists():
    named = {m for path in SCRIPTS for m in re.findall(r"\btests/[\w./-]+\.(?:py|sh|txt)\b", path.read_text())}
    assert named, "the pattern finds the scripts' paths"
    assert sorted(p for p in named if not Path(REPO, p).is_file()) == []


def test_every_script_module_the_scripts_run_exists():
    modules = {m for path in SCRIPTS for m in re.findall(r"-m scripts\.(\w+)", path.read_text())}
    assert {"bench_rl", "bench_epoch"} <= modules
    assert sorted(m for m in modules if not Path(REPO, "scripts", f"{m}.py").is_file()) == []


def bench_commands():
    found = []
    for line in commands(Path(REPO, "tests", "gpu_check.sh")):
        match = re.search(r'-m scripts\.(bench_rl|bench_epoch)\b(.*)', line)
        if match:
            argv = shlex.split(match.group(2).replace("$out", "out"))
            found.append(pytest.param(match.group(1), argv, id=f"{match.group(1)} {' '.join(argv)[:60]}"))
    return found


@pytest.mark.parametrize("script, argv", bench_commands())
def test_every_bench_command_of_gpu_check_parses(script, argv):
    if script == "bench_rl":
        from scripts import bench_rl
        configs = bench_rl.validate_args(bench_rl.parse_args(argv))
        assert configs, "each names its configs"
    else:
        from scripts import bench_epoch
        bench_epoch.parse_args(argv)


def test_the_bench_commands_are_found():
    assert len(bench_commands()) >= 8
