"""Graceful stop on SIGTERM / SIGINT, as schedulers preempt jobs (SLURM, Kubernetes and torchelastic send
SIGTERM, then SIGKILL after a grace period).

The first signal only sets a flag: the training loop finishes the step it is in, writes a checkpoint and exits
with EXIT_PREEMPTED, telling the user to resume with `--resume auto`. That first signal also restores the
default action, so a second one ends the process at once, even inside a long C++ call (whatever it was
writing is a temporary that the next `--resume auto` removes). In a data-parallel run the ranks agree on the
step to stop at (an allreduce of the flag after every step), since a scheduler's signals reach them at
different moments.
"""
from __future__ import annotations

import signal
import sys
import threading

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, to be retried (here: resumed)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """`with GracefulStop() as stop:` ... `if stop.requested:` -- handlers for SIGTERM and SIGINT while inside
    (only in the main thread, where Python runs signal handlers; elsewhere it is inert). `signum` is the
    signal received first, None if none."""

    def __init__(self, log=None):
        self.signum: int | None = None
        self._previous: dict = {}
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        for s in SIGNALS:  # a second signal: the default action, at once
            signal.signal(s, signal.SIG_DFL)
        self._log(f"received {signal.Signals(signum).name}: finishing this step, then a checkpoint and exit "
                  "(send it again to stop at once, without a checkpoint)")

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


__all__ = ["GracefulStop", "EXIT_PREEMPTED"]
