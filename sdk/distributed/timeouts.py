"""Collective timeouts and the cores local ranks share: the settings `shardkit launch` checks before torch loads.

Kept apart from `process_group` (which re-exports them) so that `shardkit launch --help` does not import torch,
and below both `process_group` and its `watchdog`, which read the timeout.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "MAX_COLLECTIVE_TIMEOUT_S", "TIMEOUT_ENV_VAR", "check_timeout",
           "cpu_budget", "default_timeout"]

TIMEOUT_ENV_VAR = "SHARDKIT_COLLECTIVE_TIMEOUT"
# 30 minutes, torch's own default for gloo/NCCL: long enough for a first-step compile or a slow
# checkpoint on rank 0, short enough that a silent peer ends the job the same working session.
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0
# One year: torch turns the timeout into int64 milliseconds and a timedelta, and `inf` or 1e400 overflowed
# inside every rank (OverflowError); no real collective needs longer.
MAX_COLLECTIVE_TIMEOUT_S = 365 * 24 * 3600.0


def check_timeout(value: object, label: str) -> float:
    """`value` as a number of seconds in (0, one year]; ValueError starting with `label` otherwise.

    Args:
        value: a number or its text ("600", "1e3").
        label: how the message names the setting and its value, e.g. "SHARDKIT_COLLECTIVE_TIMEOUT='inf'".
    """
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{label} is not a number of seconds; use e.g. 600") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or not 0 < seconds <= MAX_COLLECTIVE_TIMEOUT_S:
        raise ValueError(f"{label} must be > 0 and finite, at most {MAX_COLLECTIVE_TIMEOUT_S:g} seconds (a year); "
                         f"use e.g. 600")
    return seconds


def default_timeout(environ: Mapping[str, str] | None = None) -> float:
    """The collective timeout in seconds: $SHARDKIT_COLLECTIVE_TIMEOUT (in `environ`, default os.environ), else 1800.

    Raises:
        ValueError: the variable is not a positive finite number of seconds (at most a year).
    """
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    return check_timeout(raw, f"{TIMEOUT_ENV_VAR}={raw!r}")


def cpu_budget() -> int:
    """The cores this process may run on (its affinity mask), which N local ranks share."""
    # NOTE: the affinity mask, not os.cpu_count(): in a container or under `taskset` the machine
    # may report 128 cores while this process may use 8.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
