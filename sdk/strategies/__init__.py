"""Strategies: where parameters, gradients and optimizer state live, and how ranks talk.

Every strategy is registered once, in :mod:`shardkit.strategies.registry`; this module serves each
registered class by name (``from shardkit.strategies import ZeRO3``), importing its engine on first use.
"""

from __future__ import annotations

from shardkit.strategies.registry import STRATEGIES, exported_strategy_class
from shardkit.utils.lazy import lazy_exports

__all__ = ["ActivationCheckpointing", "Strategy", "StrategyFamily", "SingleDevice", "DDP", "FSDP", "STRATEGIES",
           "strategy_from_name"]

# A strategy from its name or alias ("single", "ddp", "tp", "zero3", ...) with the registry's defaults, then the
# keyword arguments: strategy_from_name("zero3", offload="cpu"). It IS the registry's builder, not a copy.
strategy_from_name = STRATEGIES.build

_REMOVED = {"STRATEGY_NAMES": "use STRATEGIES.names() / STRATEGIES.aliases() for the names and "
                              "STRATEGIES.entry(name).target for the class behind one (shardkit.strategies.registry)"}


def _registered_class(name: str) -> type:
    """A registered strategy class not exported above (the ZeRO family), imported on first use so that `import
    shardkit` does not import DeepSpeed."""
    found = exported_strategy_class(name)
    if found is not None:
        return found
    if name in _REMOVED:
        raise AttributeError(f"shardkit.strategies.{name} was removed for the registry: {_REMOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# NOTE: these load on first use too, so that the registry (`shardkit estimate-memory --help`'s --strategy choices)
# does not import torch.
__getattr__, __dir__ = lazy_exports(__name__, {"ActivationCheckpointing": "activation_checkpointing",
                                               "Strategy": "base", "DDP": "ddp", "FSDP": "fsdp",
                                               "SingleDevice": "single", "StrategyFamily": "facts"},
                                    fallback=_registered_class, fallback_names=STRATEGIES.class_names)
