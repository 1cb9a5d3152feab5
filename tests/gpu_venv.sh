# Sourced by tests/gpu_check.sh (and tests/gpu/test_gpu_setup.py): the two ways a GPU machine's python is handed on.
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
    # PYTHON's site folders through site.addsitedir, which also runs their own .pth files (an editable install's
    # import hook, say), then the rest of its path as plain lines; both are appended after the venv's own folder
    "$python" - > "$site/gpu_check_parent_python.pth" <<'PY'
import os, site, sys
sitedirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
sitedirs = [p for p in sitedirs if os.path.isdir(p)]
print("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in sitedirs))
# '' (the current directory, under `python -`) is not a folder to keep
print("\n".join(p for p in sys.path if p and os.path.isdir(p) and p not in sitedirs))
PY
}

python_wrapper() {
    local python=$1 file=$2
    # an absolute path, symlinks kept (resolved, a venv's python would be its base interpreter again)
    case "$python" in */*) ;; *) python=$(command -v "$python") || return 1 ;; esac
    if [[ "$python" != /* ]]; then
        local dir
        dir=$(cd "$(dirname "$python")" && pwd) || return 1
        python="$dir/$(basename "$python")"
    fi
    mkdir -p "$(dirname "$file")"
    # single-quoted for sh, each ' written as '\''
    local quoted
    quoted=$(printf '%s' "$python" | sed "s/'/'\\\\''/g")
    printf "#!/bin/sh\nexec '%s' \"\$@\"\n" "$quoted" > "$file"
    chmod +x "$file"
}
