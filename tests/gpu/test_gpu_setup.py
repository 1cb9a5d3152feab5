"""tests/gpu_venv.sh, which tests/gpu_check.sh uses to hand a GPU machine's python on, run here on the python
running the tests (in CI and tests/run.sh a venv's python, as the GPU image's /opt/torch/.venv/bin/python3 is).

Regression: on the first GPU machine, gpu_check's venv over that python could not import torch (a venv made with
--system-site-packages sees the base interpreter's packages, not the venv's it was made from), and speedrun.sh, run
through a symlink to that python, could not either."""

import os
import subprocess
import sys

import pytest
from helpers import REPO

GPU_VENV = REPO / "tests" / "gpu_venv.sh"
# what the python running this test imports from its own environment (torch is never in a bare interpreter)
PROBE = "import os, sys, torch, pytest; print(sys.prefix); print(os.path.dirname(torch.__file__))"


def bash(script, *args):
    out = subprocess.run(["bash", "-c", f'source "{GPU_VENV}"; {script}', "bash", *map(str, args)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def probe(python):
    out = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")[:2]


def test_a_venv_over_the_tests_python_imports_its_packages_and_its_own_first(tmp_path):
    venv = tmp_path / "venv"
    bash('make_venv_over "$1" "$2"', sys.executable, venv)
    prefix, torch_dir = probe(venv / "bin" / "python")
    assert prefix == str(venv)  # a venv of its own (what gets installed goes there) ...
    assert torch_dir == os.path.dirname(__import__("torch").__file__)  # ... that sees the same torch
    # the venv's own site-packages come before the folders it borrows, so what is installed into it wins
    paths = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"],
                           capture_output=True, text=True, check=True, cwd="/").stdout.split("\n")
    own = next(i for i, p in enumerate(paths) if p.startswith(str(venv)))
    borrowed = [i for i, p in enumerate(paths) if p == os.path.dirname(os.path.dirname(__import__("torch").__file__))]
    assert borrowed and own < min(borrowed)


def test_without_a_venv_module_the_venv_is_written_by_hand_and_still_sees_the_packages(tmp_path):
    """A python whose `-m venv` fails (Debian's without python3-venv): the hand-written pyvenv.cfg path."""
    no_venv = tmp_path / "python_without_venv"
    no_venv.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m venv" ] && exit 1\nexec "{sys.executable}" "$@"\n')
    no_venv.chmod(0o755)
    venv = tmp_path / "venv"
    bash('make_venv_over "$1" "$2"', no_venv, venv)
    assert (venv / "pyvenv.cfg").is_file() and not (venv / "bin" / "activate").exists()  # not made by the module
    prefix, torch_dir = probe(venv / "bin" / "python")
    assert prefix == str(venv)
    assert torch_dir == os.path.dirname(__import__("torch").__file__)


@pytest.mark.slow
def test_the_wrapper_runs_the_python_it_names_with_its_arguments(tmp_path):
    wrapper = tmp_path / "bin" / "python"
    bash('python_wrapper "$1" "$2"', sys.executable, wrapper)
    assert probe(wrapper) == probe(sys.executable)
    # named by a relative path (PYTHON=.venv/bin/python), it still runs from anywhere (probe runs in /)
    relative = os.path.relpath(sys.executable, tmp_path)
    subprocess.run(["bash", "-c", f'source "{GPU_VENV}"; cd "$1" && python_wrapper "$2" "$3"', "bash", tmp_path,
                    relative, wrapper], check=True, timeout=60)
    assert probe(wrapper) == probe(sys.executable)
    out = subprocess.run([str(wrapper), "-c", "import sys; print(sys.argv[1:])", "a b", "c"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['a b', 'c']"


def test_a_venv_and_its_wrapper_in_a_folder_named_with_quotes_spaces_and_dollars(tmp_path):
    folder = tmp_path / "a b'c $HOME \"d"
    folder.mkdir()
    bash('make_venv_over "$1" "$2" && python_wrapper "$2/bin/python" "$3"', sys.executable, folder / "venv",
         folder / "bin" / "python")
    prefix, torch_dir = probe(folder / "bin" / "python")
    assert prefix == str(folder / "venv")
    assert torch_dir == os.path.dirname(__import__("torch").__file__)
