"""How a Runner is put together from its arguments: strategy and precision by name, ``accelerate launch``'s
variables, the default strategy, activation checkpointing settings, and the steps ``Runner.setup`` takes around
the strategy's wrapping (building the C++ ops first, forward under autocast)."""

from __future__ import annotations

import functools
import os
from typing import Any

from torch import nn

from shardkit.precision import Precision
from shardkit.strategies.base import Strategy

__all__ = ["activation_checkpointing_of", "autocast_forward", "by_name", "default_strategy", "launched_strategy",
           "prebuild_kernels"]


def default_strategy() -> Strategy:
    from shardkit.strategies.ddp import DDP
    from shardkit.strategies.single import SingleDevice

    return DDP() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else SingleDevice()


def prebuild_kernels(model: nn.Module) -> None:
    """Build the C++ ops now, saying so, when the model uses shardkit's fused modules: not inside step 1, where
    the build's 30-80 s would show as a progress bar whose ETA counts the build as a step. Built once per machine."""
    if not any(type(m).__module__.startswith(("shardkit.nn", "shardkit.models")) for m in model.modules()):
        return
    from shardkit.ops import BUILDER, forced_backend

    if forced_backend() not in (None, "cpp", "cuda"):
        return
    BUILDER.available()  # logs the build with its folder and time; a failure warns once and ops fall back


def by_name(strategy: Any, precision: Any, mixed_precision: Any) -> tuple[Strategy | None, Precision | None]:
    """``Runner("fsdp", "bf16")`` and Accelerate's ``mixed_precision="bf16"``: names built through the registries."""
    from shardkit.precision.registry import PRECISIONS
    from shardkit.strategies.registry import STRATEGIES

    if mixed_precision is not None:
        if precision is not None:
            raise ValueError(f"Runner(precision={precision!r}, mixed_precision={mixed_precision!r}): pass one of "
                             f"them (mixed_precision is Accelerate's name for precision)")
        precision = mixed_precision
    if isinstance(strategy, str):
        strategy = STRATEGIES.build(strategy)
    if isinstance(precision, str):
        precision = PRECISIONS.build(precision)
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"Runner(strategy=...) takes a strategy object such as DDP() or FSDP(), or a name among "
                        f"{', '.join(STRATEGIES.names())}; got a {type(strategy).__name__}")
    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(f"Runner(precision=...) takes a precision object such as BF16(), or a name among "
                        f"{', '.join(PRECISIONS.names())}; got a {type(precision).__name__}")
    return strategy, precision


def launched_strategy(strategy: Strategy | None, precision: Precision | None) -> tuple[Any, Any, str | None]:
    """(strategy, DeepSpeed config, its name) from ``accelerate launch``'s FSDP/DeepSpeed variables, for a Runner
    given no config: the launcher's engine when ``strategy`` is None, ``strategy`` when it is of the class the
    launcher asked for, an error naming the variable when it is another (a script must not train another way than
    it was launched)."""
    from shardkit.config.accelerate_env import from_accelerate_launch, reconcile_strategy

    # The launcher's precision fills a DeepSpeed config's precision section unless the script gave one.
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no") if precision is None else "no"
    launched = from_accelerate_launch(mixed)
    if launched is None:
        return strategy, None, None
    if launched.kind == "DEEPSPEED" and strategy is None:
        return None, launched.deepspeed, launched.source
    return reconcile_strategy(launched, strategy, "Runner(strategy=...)"), None, None


def activation_checkpointing_of(value: Any, config: Any) -> Any:
    """The Runner's checkpointing settings: the explicit argument, else the config's section (False keeps
    the section's deepspeed.checkpointing options with no block patched)."""
    from shardkit.strategies.activation_checkpointing import resolve_activation_checkpointing, with_options

    from_file = getattr(config, "activation_checkpointing", None)
    if value is None or from_file is None:
        return resolve_activation_checkpointing(value if value is not None else from_file)
    explicit = resolve_activation_checkpointing(value)
    if explicit is None:
        return with_options(from_file, blocks=False)
    return with_options(explicit, deepspeed=from_file.deepspeed)


def autocast_forward(model: nn.Module, context) -> None:
    """Run ``model.forward`` under the precision's autocast, without wrapping the module (keys stay)."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with context():
            return forward(*args, **kwargs)

    model.forward = autocast_forward


def count_parameters(strategy: Strategy, model: nn.Module) -> int:
    """``model``'s whole parameter count under ``strategy`` (ZeRO-3's partitioned ones and FSDP's shards counted
    whole), tied parameters once: :meth:`shardkit.Runner.num_parameters`, and the run's size in OOM reports."""
    params = {id(p): p for p in strategy.unwrap(model).parameters()}.values()
    return sum(strategy.parameter_numel(p) for p in params)
