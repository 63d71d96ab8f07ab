"""What a job under ``shardkit launch --max-restarts N`` and its launcher tell each other.

The launcher tells each attempt, through the environment:

* ``SHARDKIT_RESTART_COUNT``: how many attempts ran before this one; above 0 this start is a restart, and the
  Runner's ``resume(..., mode="auto")`` and the Trainer resume from the newest complete checkpoint by themselves;
* ``SHARDKIT_RESTART_DIR``: a folder the launcher owns for the records below;
* on a restart, ``SHARDKIT_RESTART_FAILED_AT`` and ``SHARDKIT_RESTART_DETECTED_AT`` (Unix times: when the previous
  attempt's first rank died, and when the launcher had its end) and ``SHARDKIT_RESTART_LAST_STEP`` (the highest
  optimizer step any earlier attempt reached), from which the job measures the time the failure cost.

The job tells the launcher, through small JSON files in that folder (each replaced whole, never half written):

* ``progress.<attempt>.json`` (local rank 0, at each step, save and load): the highest step reached, the step it
  resumed from and the newest step it published a checkpoint of; the launcher reads progress from it;
* ``error.<attempt>.rank<r>.json`` (every rank whose script ends on an exception): the error's last line and time;
* ``recovery.<attempt>.json`` (local rank 0, once the replayed steps are done): the time lost to the failure
  before this attempt: detection, restart, load, replayed steps.

Nothing here imports torch: the launcher reads these records before its ranks start.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["DETECTED_AT_ENV", "FAILED_AT_ENV", "LAST_STEP_ENV", "RESTART_COUNT_ENV", "RESTART_DIR_ENV",
           "RESTART_VARIABLES", "ProgressRecord", "RestartFacts", "install_failure_record", "read_errors",
           "read_progress", "read_recovery", "restart_count", "restart_facts", "write_error", "write_recovery"]

RESTART_COUNT_ENV = "SHARDKIT_RESTART_COUNT"
RESTART_DIR_ENV = "SHARDKIT_RESTART_DIR"
FAILED_AT_ENV = "SHARDKIT_RESTART_FAILED_AT"
DETECTED_AT_ENV = "SHARDKIT_RESTART_DETECTED_AT"
LAST_STEP_ENV = "SHARDKIT_RESTART_LAST_STEP"
# Set by a restarting launcher for its own attempts only. A launch started inside such a job (a script that launches
# another job, a notebook_launcher call in a rank) must not inherit them: its ranks would take a first start for a
# restart, resume from whatever checkpoints their folder holds, and write their records over the outer job's.
RESTART_VARIABLES = (RESTART_COUNT_ENV, RESTART_DIR_ENV, FAILED_AT_ENV, DETECTED_AT_ENV, LAST_STEP_ENV)

_MAX_RECORD = 1 << 16  # a record is a few hundred bytes; anything bigger in the folder is not one of ours


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many attempts of this job ran before this process's (0 outside ``shardkit launch --max-restarts``).

    Raises:
        ValueError: the variable is set but is not a whole number >= 0 (named with its value).
    """
    raw = (os.environ if environ is None else environ).get(RESTART_COUNT_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"environment variable {RESTART_COUNT_ENV}={raw!r} must be a whole number >= 0 (the "
                         f"launcher sets it: the attempts of this job that ran before this one)")
    return int(raw)


@dataclass(frozen=True)
class RestartFacts:
    """This attempt's place in a restarting job, as the launcher described it.

    Attributes:
        attempt: attempts before this one (0: the first start).
        folder: the launcher's folder for the records.
        failed_at / detected_at: Unix times the previous attempt failed and ended (None on the first start).
        last_step: the highest optimizer step an earlier attempt reached (-1: none, or not known).
    """

    attempt: int
    folder: Path
    failed_at: float | None = None
    detected_at: float | None = None
    last_step: int = -1

    @property
    def is_restart(self) -> bool:
        return self.attempt > 0


def restart_facts(environ: Mapping[str, str] | None = None) -> RestartFacts | None:
    """The launcher's description of this attempt; None when the job does not run under ``--max-restarts``."""
    env = os.environ if environ is None else environ
    folder = env.get(RESTART_DIR_ENV, "").strip()
    if not folder:
        return None
    last = _float(env, LAST_STEP_ENV)
    return RestartFacts(restart_count(env), Path(folder), _float(env, FAILED_AT_ENV), _float(env, DETECTED_AT_ENV),
                        -1 if last is None else int(last))


def _float(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number (the launcher sets it)") from None


def _write(path: Path, record: Mapping[str, Any]) -> None:
    """Replace ``path`` whole (a reader never sees half a record); a record that cannot be written is dropped:
    it only ever costs the launcher's report, never the training."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        if path.is_symlink() or path.stat().st_size > _MAX_RECORD:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _step(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


class ProgressRecord:
    """Local rank 0's ``progress.<attempt>.json``: the highest step reached, the step resumed from, the newest
    step a checkpoint was published of. Written only when one of them changes."""

    def __init__(self, facts: RestartFacts):
        self.path = facts.folder / f"progress.{facts.attempt}.json"
        self.values: dict[str, int | None] = {"step": None, "resumed": None, "saved": None}

    def update(self, **values: int | None) -> None:
        changed = False
        for key, value in values.items():
            old = self.values[key]
            if value is not None and (old is None or value > old or key == "resumed"):
                self.values[key], changed = value, True
        if changed:
            _write(self.path, self.values)


def read_progress(folder: str | os.PathLike, attempt: int) -> dict[str, int | None]:
    """What attempt ``attempt`` recorded (each value None when unknown: a script without the Runner, or one that
    died before its first step)."""
    data = _read(Path(folder, f"progress.{attempt}.json")) or {}
    return {key: _step(data.get(key)) for key in ("step", "resumed", "saved")}


def install_failure_record(facts: RestartFacts, rank: int) -> None:
    """Leave ``error.<attempt>.rank<r>.json`` when this process ends on an exception (chains the previous hook,
    once per process), so that the launcher can tell one failure from another and name it."""
    previous = sys.excepthook
    if getattr(previous, "_shardkit_restart", False):
        return

    def hook(kind, value, tb):
        line = traceback.format_exception_only(kind, value)[-1].strip() if kind is not None else "unknown error"
        write_error(facts.folder, facts.attempt, rank, line, time.time())
        previous(kind, value, tb)

    hook._shardkit_restart = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def write_error(folder: str | os.PathLike, attempt: int, rank: int, line: str, when: float) -> None:
    """``error.<attempt>.rank<r>.json``: the last line of the error that ended rank ``rank``, and when."""
    _write(Path(folder, f"error.{attempt}.rank{rank}.json"), {"error": line[:2000], "time": when})


def read_errors(folder: str | os.PathLike, attempt: int) -> dict[int, tuple[str, float]]:
    """rank -> (the error's last line, when it was raised) for attempt ``attempt``."""
    found: dict[int, tuple[str, float]] = {}
    prefix = f"error.{attempt}.rank"
    try:
        names = [p.name for p in Path(folder).iterdir()]
    except OSError:
        return found
    for name in names:
        rank = name[len(prefix):-len(".json")] if name.startswith(prefix) and name.endswith(".json") else ""
        data = _read(Path(folder, name)) if rank.isascii() and rank.isdigit() else None
        if data and isinstance(data.get("error"), str) and isinstance(data.get("time"), (int, float)):
            found[int(rank)] = (data["error"], float(data["time"]))
    return found


def write_recovery(facts: RestartFacts, record: Mapping[str, Any]) -> None:
    """Local rank 0: the time lost to the failure before this attempt (see :class:`shardkit.runner.recovery`)."""
    _write(facts.folder / f"recovery.{facts.attempt}.json", record)


def read_recovery(folder: str | os.PathLike, attempt: int) -> dict[str, Any] | None:
    """What :func:`write_recovery` left for attempt ``attempt``; None when the job did not get that far."""
    data = _read(Path(folder, f"recovery.{attempt}.json"))
    keys = ("detect_s", "restart_s", "load_s", "replay_s", "lost_s")
    if data is None or not all(isinstance(data.get(k), (int, float)) for k in keys):
        return None
    return data
