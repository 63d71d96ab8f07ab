""""Did you mean" hints for unknown names: one place, so every error suggests the same way."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["by_closeness", "closest", "did_you_mean"]


def _normalise(name: str) -> str:
    return name.lower().replace("-", "_")


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate nearest to ``name`` (difflib), or None when nothing is near.

    Case and separator slips ("Stage", "zero-stage") score low with difflib on the raw strings, so a
    second pass compares the normalised forms.
    """
    names = [str(c) for c in candidates]
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if match:
        return match[0]
    by_norm = {_normalise(n): n for n in names}
    match = difflib.get_close_matches(_normalise(name), list(by_norm), n=1, cutoff=0.6)
    return by_norm[match[0]] if match else None


def did_you_mean(name: str, candidates: Iterable[str], *, prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the nearest candidate, or ``""`` when none is near.

    Args:
        name: The unknown name the user gave.
        candidates: The valid names.
        prefix: Prepended to the suggestion, e.g. a dotted config path ``"zero_optimization."``.
    """
    near = closest(name, candidates)
    return f"; did you mean {prefix + near!r}?" if near else ""


def by_closeness(name: str, candidates: Iterable[str]) -> list[str]:
    """Every distinct candidate, the nearest to ``name`` first (difflib's ratio on the normalised forms), for an error
    that lists what there is to choose from."""
    target = _normalise(name)
    names = sorted({str(c) for c in candidates})
    return sorted(names, key=lambda n: -difflib.SequenceMatcher(None, target, _normalise(n)).ratio())
