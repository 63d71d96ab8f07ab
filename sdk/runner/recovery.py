"""The Runner's side of a job that ``shardkit launch --max-restarts`` restarts after a failure.

It tells the launcher how far the job got (the highest step, the step it resumed from, the newest checkpoint it
published) and which error ended a rank, so that the launcher can tell a job that fails the same way without
progress from one that moves on; and on a restart it measures what the failure cost, from the moment the first rank
died until the job is back at the step it had reached: detection (the launcher seeing the whole attempt end),
restart (new processes, imports, process group, model, until the load begins), load, and the replayed steps. Those
figures go to the run log (``restart/*`` in the trackers of ``log_with``), to the rank-0 log, and to the launcher,
which prints one line per failure at the end. Outside ``--max-restarts`` it does nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from shardkit.distributed.restart_records import (
    ProgressRecord,
    install_failure_record,
    restart_facts,
    write_recovery,
)

__all__ = ["RunRecovery"]


class RunRecovery:
    """Progress records and the time lost per failure, for one process of a restarting job.

    Args:
        rank: this process's global rank (its error record is named after it).
        local_main: local rank 0, which writes the progress and the measured time (one writer per machine).
        log: the run log (``RunnerObservability.log``): ``log(values, step)``.
        logger: the rank's logger.
    """

    def __init__(self, rank: int, local_main: bool, log: Callable[[dict[str, Any], int], None],
                 logger: logging.Logger | logging.LoggerAdapter):
        self.facts = restart_facts()
        self._local_main = local_main
        self._log = log
        self._logger = logger
        self._progress = ProgressRecord(self.facts) if self.facts is not None and local_main else None
        self._pending: dict[str, float] | None = None  # the failure being measured, until its replay ends
        self._accounted = False  # this process measured (or began measuring) its failure
        if self.facts is not None:
            install_failure_record(self.facts, rank)

    @property
    def is_restart(self) -> bool:
        """This process belongs to an attempt the launcher restarted (its checkpoints are to be resumed)."""
        return self.facts is not None and self.facts.is_restart

    def loaded(self, started: float, step: int) -> None:
        """A full load (weights, optimizer, step position) that began at ``started`` ended; the state is at ``step``.
        The first one of a restarted process is its resume."""
        if self._progress is not None:
            self._progress.update(resumed=step)
        if not self.is_restart or self._accounted:
            return
        self._accounted = True
        self._pending = {"started": started, "loaded": time.time(), "from_step": float(step)}
        self._maybe_caught_up(step)

    def after_step(self, step: int) -> None:
        """The optimizer step count is ``step`` after a step (applied or skipped)."""
        if self._progress is not None:
            self._progress.update(step=step)
        if self.is_restart and not self._accounted:
            # restarted with nothing to load (it failed before its first checkpoint): it replays from step 0
            now = time.time()
            self._accounted = True
            self._pending = {"started": now, "loaded": now, "from_step": 0.0}
        self._maybe_caught_up(step)

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was published."""
        if self._progress is not None:
            self._progress.update(saved=step)

    def _maybe_caught_up(self, step: int) -> None:
        pending, facts = self._pending, self.facts
        if pending is None or facts is None or step < facts.last_step:
            return
        self._pending = None
        now = time.time()
        failed = facts.failed_at if facts.failed_at is not None else pending["started"]
        detected = facts.detected_at if facts.detected_at is not None else failed
        from_step = int(pending["from_step"])
        record = {"detect_s": max(0.0, detected - failed), "restart_s": max(0.0, pending["started"] - detected),
                  "load_s": pending["loaded"] - pending["started"], "replay_s": now - pending["loaded"],
                  "lost_s": now - failed, "replayed_steps": max(0, facts.last_step - from_step),
                  "from_step": from_step, "restart": facts.attempt}
        self._log({f"restart/{key}": value for key, value in record.items()}, step)
        if not self._local_main:
            return
        write_recovery(facts, record)
        self._logger.info("restart %d: %.2f s lost to the failure (detection %.2f s + restart %.2f s + load %.2f s + "
                          "%d replayed step(s) %.2f s), resumed from step %d", facts.attempt, record["lost_s"],
                          record["detect_s"], record["restart_s"], record["load_s"], record["replayed_steps"],
                          record["replay_s"], from_step)
