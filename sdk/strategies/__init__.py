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

__all__ = ["ActivationCheckpointing", "Strategy", "SingleDevice", "DDP", "FSDP", "STRATEGIES", "strategy_from_name"]

# A strategy from its name or alias ("single", "ddp", "tp", "zero3", ...) with the registry's defaults, then the
# keyword arguments: strategy_from_name("zero3", offload="cpu"). It IS the registry's builder, not a copy.
strategy_from_name = STRATEGIES.build

_REMOVED = {"STRATEGY_NAMES": "use STRATEGIES.names() / STRATEGIES.aliases() for the names and "
                              "STRATEGIES.entry(name).target for the class behind one (shardkit.strategies.registry)"}


def __getattr__(name: str):
    # Registered classes not imported above load on first use, so `import shardkit` does not import DeepSpeed.
    if name in STRATEGIES.class_names():
        return STRATEGIES.get_class(name)
    if name in _REMOVED:
        raise AttributeError(f"shardkit.strategies.{name} was removed (issue 24): {_REMOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *STRATEGIES.class_names()})
