"""
Atomic file writes: a file is written to a hidden temp file in its own directory, fsynced, and only then
renamed over its final name (os.replace is atomic within one filesystem). A crash, a kill or a full disk
therefore never leaves half a file under the final name: readers see the old file or the new one.

`atomic_write` does all of it for one file. `stage` and `os.replace` split it in two, for a caller that
commits several files in an order of its own (checkpoint_manager renames the model file last).

Below them: checking before a script spends anything (a step, a question) that the paths it will write can be
written (check_writable_dir, check_writable_file), and one line, not a traceback, for a write that fails later
(write_errors).
"""

import contextlib
import errno
import glob
import os

from nanochat.errors import UserError


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


# -----------------------------------------------------------------------------
# paths a script will write: checked before it spends anything, and a failed write later said in one line

class NotWritableError(UserError):
    """A path a script will write cannot be written, found before the script's first step or question."""

    def __init__(self, what, path, reason, fix):
        super().__init__(f"cannot write {what} to {path}: {reason}; {fix}")
        self.path = path


class WriteFailedError(UserError):
    """A write that failed once the script was under way: the path, the reason, what was kept, what to do."""

    def __init__(self, path, reason, kept, fix):
        super().__init__(f"could not write {path}: {reason}; {kept}; {fix}")
        self.path = path


def write_fix(e):
    """What to do about the failed write OSError e."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space, or write elsewhere"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable, or write elsewhere"
    return "check the disk, or write elsewhere"


def _blocking_file(path):
    """The first component of `path` that exists and is not a directory (a file where a folder should be), or None."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i])
        if not os.path.isdir(prefix):
            return prefix if os.path.lexists(prefix) else None
    return None


def check_writable_dir(directory, what, fix):
    """Say now, in one line (NotWritableError naming `what` and `fix`), if no file can be created in `directory`:
    the folders missing on the way are created, a hidden probe file written and removed, and the folders this made
    removed again, so a check leaves nothing behind (even a refused run's). Root ignores permissions, not a file
    where a folder should be: that fails for everyone. Every rank of a run may check the same folder at once: one
    whose folder another's check removed tries again."""
    directory = os.path.abspath(directory)
    blocking = _blocking_file(directory)
    if blocking is not None:
        reason = "it is a file, not a folder" if blocking == directory else f"Not a directory ({blocking} is a file)"
        raise NotWritableError(what, directory, reason, fix)
    probe, made = os.path.join(directory, f".write-probe-{os.getpid()}"), []
    try:
        for _ in range(3):
            d = directory
            while not os.path.lexists(d):  # deepest first: the order to remove them in
                made.append(d)
                d = os.path.dirname(d)
            try:
                os.makedirs(directory, exist_ok=True)
                with open(probe, "wb") as f:
                    f.write(b"probe")
                os.remove(probe)
                return directory
            except FileNotFoundError as e:  # the folder went between the two: another rank's check removed it
                error = e
            except OSError as e:
                error = e
                break
        raise NotWritableError(what, directory, error.strerror or str(error), fix) from error
    finally:
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                pass  # gone already, or holding another rank's probe (an empty folder may then stay)


def check_writable_file(path, what, fix):
    """As check_writable_dir, for the file `path`: its folder writable, and the path neither a folder nor a file that
    cannot be opened for writing."""
    check_writable_dir(os.path.dirname(os.path.abspath(path)), what, fix)
    if os.path.isdir(path):
        raise NotWritableError(what, path, "it is a directory", fix)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise NotWritableError(what, path, "Permission denied", fix)
    return path


@contextlib.contextmanager
def write_errors(kept, fix=write_fix):
    """Inside: an OSError of a file (a write that failed: disk full, permissions changed) becomes one line,
    WriteFailedError, naming the file, the reason, what was kept (`kept()`, asked only then) and what to do (`fix(e)`)."""
    try:
        yield
    except OSError as e:
        if e.filename is None or isinstance(e, (ConnectionError, TimeoutError)):
            raise  # not a file's write (a socket, a collective's timeout): its own error, not "could not write"
        raise WriteFailedError(e.filename, e.strerror or str(e), kept(), fix(e)) from e
