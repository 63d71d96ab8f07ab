"""argparse types for numbers with ranges: a bad value is one argparse line, never a traceback.

    parser.add_argument("--num-gpus", type=int_range(1, 1_000_000), default=1)
    parser.add_argument("--additional-buffer-factor", type=float_range(above=0), default=1.5)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["float_range", "int_range"]


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
