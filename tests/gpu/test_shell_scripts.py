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


def stage_body(name):
    """The text of gpu_check.sh's run_stage case for stage `name`."""
    text = Path(REPO, "tests", "gpu_check.sh").read_text()
    body = text.split("run_stage() {", 1)[1].split(f"\n{name})\n", 1)[1]
    return body.split("\n    ;;\n", 1)[0]


@pytest.mark.parametrize("stage", ["checks", "kernels"])
def test_the_kernel_checks_run_before_any_timing_and_gate_the_triton_bench(stage):
    """Issue 73: the stages that time the Triton step run its kernels' correctness part first (before any bench), and
    time the Triton step only through triton_bench, which is given that part's exit and runs nothing where it failed;
    the stage's exit includes the part's."""
    body = stage_body(stage)
    assert body.index("kernel_checks\n") < min(body.index(timing) for timing in ("scripts.bench_rl", "triton_bench"))
    assert "kernels_rc=$?" in body and 'triton_bench "$kernels_rc"' in body
    assert "batched_bf16_graph_triton" not in body  # only triton_bench times the Triton step
    assert '[ "$kernels_rc" -eq 0 ]' in body.splitlines()[-1]
    gate = Path(REPO, "tests", "gpu_check.sh").read_text().split("triton_bench() {", 1)[1].split("\n}\n", 1)[0]
    assert gate.index('if [ "$1" -ne 0 ]') < gate.index("return 1") < gate.index("batched_bf16_graph_triton")
