"""Settings read from the environment."""

from __future__ import annotations

import math
import os

__all__ = ["seconds_from_env"]


def seconds_from_env(name: str, default: float) -> float:
    """A time limit from environment variable ``name``: ``default`` when unset or blank.

    Raises:
        ValueError: the value is not a number, or not a positive, finite number of seconds (naming the
            variable, its value and an example).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r:.40} is not a number of seconds; set it to e.g. {default:.0f}") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{name}={raw!r:.40} must be a positive, finite number of seconds (e.g. {default:.0f})")
    return value
