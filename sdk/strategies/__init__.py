"""Strategies: where parameters, gradients and optimizer state live, and how ranks talk.

Every strategy is registered once, in :mod:`shardkit.strategies.registry`; this module serves each
registered class by name (``from shardkit.strategies import ZeRO3``), importing its engine on first use.
"""

from __future__ import annotations

from shardkit.strategies.activation_checkpointing import ActivationCheckpointing
from shardkit.strategies.base import Strategy
from shardkit.strategies.ddp import DDP
from shardkit.strategies.fsdp import FSDP
from shardkit.strategies.registry import STRATEGIES
from shardkit.strategies.single import SingleDevice

__all__ = ["ActivationCheckpointing", "Strategy", "SingleDevice", "DDP", "FSDP", "STRATEGIES", "STRATEGY_NAMES",
           "strategy_from_name"]

# Every accepted name and alias -> "module:Class" (kept for callers of the old table; the registry is the source).
STRATEGY_NAMES = STRATEGIES.targets()


def strategy_from_name(name: str, **kwargs) -> Strategy:
    """Build a strategy from its name or alias ("single", "ddp", "tp", "zero3", ...), e.g. for command-line flags.

    Same as ``STRATEGIES.build(name, **kwargs)``: unset arguments take the class's defaults (``tp`` spans
    every rank, ``zero_infinity`` swaps to the default NVMe directory).

    Raises:
        ValueError: an unknown name (with the closest known one and the list of names).
    """
    return STRATEGIES.build(name, **kwargs)


def __getattr__(name: str):
    # Registered classes not imported above load on first use, so `import shardkit` does not import DeepSpeed.
    if name in STRATEGIES.class_names():
        return STRATEGIES.get_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *STRATEGIES.class_names()})
