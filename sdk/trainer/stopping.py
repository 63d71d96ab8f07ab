"""Stop requests from outside the loop: SIGTERM (preemption) on any rank and the ``max_time`` budget.

The Trainer asks :meth:`StopRequests.check` after every optimizer step; every rank gets the same answer (one
all-reduce of two flags), so all ranks save the same checkpoint and stop together. Nothing here is saved in
checkpoints: a resumed run gets a fresh ``max_time`` budget, as Hugging Face's does.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import torch

__all__ = ["StopRequests"]


class StopRequests:
    """SIGTERM and wall-clock stop requests for one ``train()`` call.

    Args:
        runner: the Trainer's Runner (its ``all_reduce``, ``is_main_process``, ``device``).
        save_on_sigterm: install a SIGTERM handler (main thread only) for the duration of training.
        max_time: seconds of wall clock from :meth:`start` (rank 0's clock decides), or None.
    """

    def __init__(self, runner: Any, save_on_sigterm: bool, max_time: float | None):
        self.runner, self.save_on_sigterm, self.max_time = runner, save_on_sigterm, max_time
        self._signal = threading.Event()
        self._previous: Any = None
        self._installed = False
        self._start = time.monotonic()

    def start(self) -> None:
        """Start the clock and install the SIGTERM handler (restored by :meth:`stop`)."""
        self._start = time.monotonic()
        self._signal.clear()
        if self.save_on_sigterm and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda signum, frame: self._signal.set())
            self._installed = True

    def stop(self) -> None:
        """Restore the SIGTERM handler that was there before :meth:`start`."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def check(self) -> str | None:
        """The reason to stop now (the same on every rank), or None. A collective when anything is watched."""
        if not self.save_on_sigterm and self.max_time is None:
            return None
        over = self.max_time is not None and time.monotonic() - self._start > self.max_time
        flags = torch.tensor([float(self._signal.is_set()), float(over and self.runner.is_main_process)])
        if self.runner.world_size > 1:
            flags = self.runner.all_reduce(flags.to(self.runner.device), "max").cpu()
        if flags[0]:
            return "SIGTERM"
        if flags[1]:
            return f"max_time={self.max_time}s"
        return None
