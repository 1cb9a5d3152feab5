"""
A long run stopped by a signal without losing its work: the first SIGINT/SIGTERM stops it at the next step boundary,
where it saves; a second exits at once.
"""

import os
import signal
import sys

from nanochat.runtime.distributed import any_rank, print0


class GracefulStop:
    """SIGINT/SIGTERM handling for long runs: the first signal asks the loop to stop at the next step
    boundary (it then saves and exits); a second signal exits at once."""

    def __init__(self):
        self.signum = None
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        if self.signum is not None:
            print(f"received {signal.Signals(signum).name} again: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        print0(f"received {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
               f"(send it again to exit at once)")

    def requested(self, device="cpu"):
        """True if any rank received a signal (all ranks must agree, or their collectives would hang)."""
        return any_rank(self.signum is not None, device)
