"""argparse types for numbers with ranges: a bad value is one argparse line, never a traceback.

    parser.add_argument("--num-gpus", type=int_range(1, 1_000_000), default=1)
    parser.add_argument("--additional-buffer-factor", type=float_range(above=0), default=1.5)
    parse_int_list("2,6", "Pipeline layer_split", minimum=1)   # (2, 6), as --strategy-opt layer_split=2,6 gives it
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["float_range", "int_range", "parse_int_list"]


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _bounds(minimum: float | None, maximum: float | None, above: float | None = None) -> str:
    parts = [f">= {_num(minimum)}" if minimum is not None else "", f"> {_num(above)}" if above is not None else "",
             f"<= {_num(maximum)}" if maximum is not None else ""]
    return " and ".join(p for p in parts if p)


def int_range(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number within ``[minimum, maximum]`` (either bound optional)."""
    wanted = f"a whole number {_bounds(minimum, maximum)}".strip()

    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {wanted}") from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{value} is out of range: use {wanted}")
        return value

    parse.__name__ = "whole number"  # argparse names the type in "invalid <name> value" messages
    return parse


def float_range(minimum: float | None = None, maximum: float | None = None,
                above: float | None = None) -> Callable[[str], float]:
    """A finite number within the bounds (``above``: exclusive lower bound); NaN, inf and ``1e400`` refused."""
    wanted = f"a finite number {_bounds(minimum, maximum, above)}".strip()

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {wanted}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {wanted} (NaN and infinity are refused; 1e400 "
                                             f"overflows to infinity)")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum) or \
                (above is not None and value <= above):
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: use {wanted}")
        return value

    parse.__name__ = "number"
    return parse


def parse_int_list(text: str, what: str, minimum: int | None = None) -> tuple[int, ...]:
    """Comma-separated whole numbers (``"2,6"``, ``"(2, 6)"`` or ``"[2, 6]"``), each ``>= minimum``.

    Raises:
        ValueError: an empty list, a part that is not a whole number, or one out of range; the message names
            ``what``, the part and the expected form.
    """
    wanted = f"comma-separated whole numbers {_bounds(minimum, None)}".strip()
    body = str(text).strip().strip("()[]")
    parts = [p.strip() for p in body.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{what}={str(text)[:40]!r} is empty; give {wanted}, e.g. 2,6")
    values = []
    for part in parts:
        try:
            value = int(part.replace("_", ""))
        except ValueError:
            raise ValueError(f"{what}={str(text)[:40]!r}: {part[:20]!r} is not a whole number; give {wanted}, "
                             "e.g. 2,6") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"{what}={str(text)[:40]!r}: {value} is out of range; give {wanted}")
        values.append(value)
    return tuple(values)
