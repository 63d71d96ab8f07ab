"""SIGTERM and SIGINT reaching a launcher: caught, so that the launcher can pass them on to its job.

A launcher killed outright orphans its ranks. While `catch_stop_signals()` is active, the two
signals are recorded instead of acting; the launcher's loop sees them, sends SIGTERM to every rank, gives
them a grace to save (the Trainer saves a checkpoint on SIGTERM), kills what is left, and finally
`redeliver()`s the signal so that the launcher ends the way it would have without the job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

__all__ = ["STOP_GRACE_S", "STOP_SIGNALS", "catch_stop_signals", "redeliver"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds ranks get between the forwarded SIGTERM and SIGKILL: long enough to write a checkpoint of a few
# GB to a local disk, short enough for a scheduler's own kill timeout (SLURM's KillWait defaults to 30 s).
STOP_GRACE_S = 25.0


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[list[int]]:
    """Record SIGTERM/SIGINT in the yielded list while the block runs; restore the old handlers after.

    Only signals whose handler is the default one are caught (a program with its own handler keeps it),
    and only in the main thread (Python delivers signals there alone).
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    saved = {}
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            saved[sig] = current
            signal.signal(sig, lambda signum, _frame: received.append(signum))
    try:
        yield received
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def redeliver(signum: int) -> None:
    """Act on a recorded signal as its default handler would: KeyboardInterrupt for SIGINT, else die of it."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
