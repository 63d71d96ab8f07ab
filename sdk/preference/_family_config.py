"""Checks the KTO, ORPO and CPO configs share: a value among choices, a positive number, and TRL settings that
shardkit does not run refused when set (instead of being accepted and ignored)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from shardkit.utils.suggest import did_you_mean

__all__ = ["check_choice", "check_positive", "refuse_unless_default"]


def check_choice(config: Any, name: str, choices: Sequence[str]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(f"{type(config).__name__}.{name}={value!r} is not one of {list(choices)}"
                         f"{did_you_mean(str(value), choices)}")


def check_positive(config: Any, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{type(config).__name__}.{name}={value!r} must be a number > 0")


def _default(config: Any, name: str) -> Any:
    for f in dataclasses.fields(config):
        if f.name == name:
            return f.default() if callable(f.default) else f.default  # no default_factory fields here
    raise AttributeError(name)


def refuse_unless_default(config: Any, reasons: Mapping[str, str]) -> None:
    """Each named field must hold TRL's default: a run that would silently skip a setting fails here instead,
    naming the field, why it is not run, and the value to set."""
    for name, reason in reasons.items():
        default = _default(config, name)
        if getattr(config, name) != default:
            raise ValueError(f"{type(config).__name__}.{name}={getattr(config, name)!r} is not supported: {reason}. "
                             f"Leave it at {default!r}")
