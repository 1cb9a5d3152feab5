# Sourced by tests/gpu_check.sh (and tests/test_gpu_setup.py): the two ways a GPU machine's python is handed on.
#
# make_venv_over PYTHON VENV   a venv at VENV, made without pip or ensurepip, that sees every package PYTHON sees
#                              (what is installed into VENV comes first).
# python_wrapper PYTHON FILE   FILE becomes an executable that runs PYTHON with its arguments.
#
# Both exist because the first GPU machine's python3 was itself a venv's (/opt/torch/.venv/bin/python3, torch
# installed in that venv, not in the interpreter it was made from):
# - `python -m venv --system-site-packages` shows the packages of the *base* interpreter, so a venv made over a
#   venv's python lost torch; make_venv_over adds a .pth file listing every folder on PYTHON's own path;
# - a symlink to a venv's python, called through the link, looks for pyvenv.cfg beside the link, misses it and runs
#   as the base interpreter (speedrun.sh said "No module named 'torch'"); a wrapper script calls the python by its
#   own path.

make_venv_over() {
    local python=$1 venv=$2
    rm -rf "$venv"
    if ! "$python" -m venv --without-pip --system-site-packages "$venv" >/dev/null 2>&1; then
        # no venv module: a venv is a pyvenv.cfg beside bin/python (what the module writes), bin/python the base
        # interpreter (a venv's python resolves to it), home its folder, whose standard library the venv runs on
        local base pyver
        base=$("$python" -c "import os, sys; print(os.path.realpath(sys.executable))")
        pyver=$("$python" -c "import sys; print('%d.%d.%d' % sys.version_info[:3])")
        mkdir -p "$venv/bin"
        ln -sf "$base" "$venv/bin/python"
        printf 'home = %s\ninclude-system-site-packages = true\nversion = %s\n' "$(dirname "$base")" "$pyver" > "$venv/pyvenv.cfg"
    fi
    local site
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || return 1
    mkdir -p "$site"
    # sys.path[0] is the current directory under -c: left out
    "$python" -c "import os, sys; print('\n'.join(p for p in sys.path[1:] if p and os.path.isdir(p)))" \
        > "$site/gpu_check_parent_python.pth"
}

python_wrapper() {
    local python=$1 file=$2
    # an absolute path, symlinks kept (resolved, a venv's python would be its base interpreter again)
    case "$python" in /*) ;; */*) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; *) python=$(command -v "$python") ;; esac
    mkdir -p "$(dirname "$file")"
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$python" > "$file"
    chmod +x "$file"
}
