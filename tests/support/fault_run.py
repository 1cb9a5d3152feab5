"""Run chat_rl with one fault at a deterministic moment of a checkpoint save (for tests/checkpoints/test_faults.py):

    python tests/support/fault_run.py ACTION:POINT:FILE [chat_rl flags...]     # also as each rank of a process group

FILE is the name of a checkpoint file (model_000002.pt, meta_000002.json, optim_000002_rank1.pt); only the
process that writes it acts, and only when it comes to it. POINT is where in the save:
  write    half of the file's bytes reach its temp file (flushed and fsynced): the model, a shard (torch.save)
           or the meta json, whatever writes it
  fsync    the file's temp file is written whole, and is being fsynced
  rename   the file is staged whole, and is being renamed into place (os.replace)
  dirsync  the file was renamed into place; the next fsync of its directory (the save's last write)
  prune    --keep-last is removing the file (an earlier step's)
ACTION is what happens there:
  kill     the process SIGKILLs itself: a node lost at that moment
  enospc   the call fails with ENOSPC (No space left on device); at prune, which writes nothing, with EIO
The older names stay: kill-writing:FILE = kill:write:FILE, kill-renaming:FILE = kill:rename:FILE,
disk-full:FILE = enospc:write:FILE. No sleep decides the moment: the save itself reaches it.
`patches(fault)` gives the (module, attribute, replacement) triples, for a test that injects a fault in-process.
"""

import errno
import io
import os
import signal
import stat
import sys

import nanochat.checkpoints.store as checkpoint_manager
from nanochat.cli import run_main
from scripts import chat_rl

ACTIONS = ("kill", "enospc")
POINTS = ("write", "fsync", "rename", "dirsync", "prune")
ALIASES = {"kill-writing": "kill:write", "kill-renaming": "kill:rename", "disk-full": "enospc:write"}


def parse(fault):
    """ACTION:POINT:FILE (or an older alias) -> (action, point, file)."""
    head, _, target = fault.rpartition(":")
    action, _, point = ALIASES.get(head, head).partition(":")
    if action not in ACTIONS or point not in POINTS or not target:
        raise SystemExit(f"fault_run: the fault must be ACTION:POINT:FILE with ACTION one of {', '.join(ACTIONS)} and "
                         f"POINT one of {', '.join(POINTS)}, got {fault!r}")
    return action, point, target


def patches(fault):
    """[(module, attribute, replacement)] that make `fault` happen in this process."""
    action, point, target = parse(fault)
    real_stage, real_fsync, real_replace, real_remove = checkpoint_manager.stage, os.fsync, os.replace, os.remove

    def strike(name, code=errno.ENOSPC):
        if action == "kill":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(code, os.strerror(code), name)

    def stage(path, write_fn, sweep_stale=False):
        if point != "write" or os.path.basename(path) != target:
            return real_stage(path, write_fn, sweep_stale)

        def half_then_fault(f):
            buffer = io.BytesIO()
            write_fn(buffer)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            real_fsync(f.fileno())
            strike(target)
        return real_stage(path, half_then_fault, sweep_stale)

    def fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if point == "fsync" and name.startswith(f".{target}.tmp-"):
            strike(target)
        if point == "dirsync" and stat.S_ISDIR(os.fstat(fd).st_mode) and os.path.exists(
                os.path.join(os.readlink(f"/proc/self/fd/{fd}"), target)):
            strike(target)
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        if point == "rename" and os.path.basename(str(dst)) == target:
            strike(target)
        return real_replace(src, dst, *args, **kwargs)

    def remove(path, *args, **kwargs):
        if point == "prune" and os.path.basename(str(path)) == target:
            strike(target, errno.EIO)
        return real_remove(path, *args, **kwargs)

    return [(checkpoint_manager, "stage", stage), (os, "fsync", fsync), (os, "replace", replace), (os, "remove", remove)]


def install(fault):
    for module, name, value in patches(fault):
        setattr(module, name, value)


if __name__ == "__main__":
    install(sys.argv[1])
    run_main(chat_rl.main, [a for a in sys.argv[2:] if a != "--"])
