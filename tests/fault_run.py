"""Run chat_rl with one fault at a deterministic moment of a checkpoint save (for tests/test_faults.py):

    python tests/fault_run.py ACTION:FILE [chat_rl flags...]     # also as each rank of a process group

FILE is the name of a checkpoint file (model_000002.pt, optim_000002_rank1.pt); only the process that writes it
acts, and only when it comes to it:
  kill-writing   half of the file's bytes reach its temp file (flushed and fsynced), then the process SIGKILLs
                 itself: a node lost in the middle of the write (model and shard files: what torch.save writes)
  kill-renaming  the file is staged whole, then the process SIGKILLs itself just before renaming it into place
  disk-full      half of the bytes land, then the write fails with ENOSPC
No sleep decides the moment: the save itself reaches it.
"""

import errno
import io
import os
import signal
import sys

import torch

from nanochat.cli import run_main
from scripts import chat_rl

ACTIONS = ("kill-writing", "kill-renaming", "disk-full")


def install(fault):
    """Patch torch.save and os.replace of this process so that `fault` (ACTION:FILE) happens."""
    action, _, target = fault.partition(":")
    if action not in ACTIONS or not target:
        raise SystemExit(f"fault_run: the fault must be ACTION:FILE with ACTION one of {', '.join(ACTIONS)}, got {fault!r}")
    real_save, real_replace = torch.save, os.replace

    def save(obj, f, *args, **kwargs):
        name = os.path.basename(str(getattr(f, "name", f)))
        if action != "kill-renaming" and name.startswith(f".{target}.tmp-"):  # files.temp_path of the target
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            os.fsync(f.fileno())
            if action == "kill-writing":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        return real_save(obj, f, *args, **kwargs)

    def replace(src, dst, *args, **kwargs):
        if action == "kill-renaming" and os.path.basename(str(dst)) == target:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *args, **kwargs)

    torch.save, os.replace = save, replace


if __name__ == "__main__":
    install(sys.argv[1])
    run_main(chat_rl.main, [a for a in sys.argv[2:] if a != "--"])
