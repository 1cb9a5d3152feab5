"""
Atomic file writes: a file is written to a hidden temp file in its own directory, fsynced, and only then
renamed over its final name (os.replace is atomic within one filesystem). A crash, a kill or a full disk
therefore never leaves half a file under the final name: readers see the old file or the new one.

`atomic_write` does all of it for one file. `stage` and `os.replace` split it in two, for a caller that
commits several files in an order of its own (checkpoint_manager renames the model file last).
"""

import glob
import os


def temp_path(path):
    """Where `path` is staged: hidden and suffixed, so neither a glob for *.pt or *.md nor a `model_N.pt`
    match ever sees it, and per process, so two processes never write the same temp file."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.tmp-{os.getpid()}")


def remove_if_exists(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def stage(path, write_fn, sweep_stale=False):
    """write_fn(binary file) into `path`'s temp file, flushed and fsynced; returns the temp path.
    On failure the temp file may remain: the caller removes it (see atomic_write).
    sweep_stale: first remove the temp files of `path` that other (killed) processes left; only for a file
    that one process at a time writes (a checkpoint file), or a live writer's temp file would go too."""
    if sweep_stale:
        directory, name = os.path.split(path)
        for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp-*")):
            remove_if_exists(stale)
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        write_fn(f)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def fsync_dir(directory):
    """Make renames in `directory` durable across a power loss. Best effort: Windows cannot open a
    directory, and some network/FUSE filesystems refuse fsync on one (EINVAL); the files are in place
    either way, so failing the write here would be wrong."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def atomic_write(path, contents, sweep_stale=False):
    """Replace the file `path` with `contents`: bytes, a str (written as UTF-8), or a function that writes
    to the open binary file. On any failure the temp file is removed and the error re-raised; an existing
    file at `path` is then left as it was. sweep_stale: see stage."""
    if callable(contents):
        write_fn = contents
    else:
        data = contents.encode("utf-8") if isinstance(contents, str) else contents
        write_fn = lambda f: f.write(data)
    try:
        os.replace(stage(path, write_fn, sweep_stale), path)
    except BaseException:
        try:
            remove_if_exists(temp_path(path))
        except OSError:
            pass  # the original error is the one worth reporting; a leftover hidden temp file is harmless
        raise
    fsync_dir(os.path.dirname(path))
