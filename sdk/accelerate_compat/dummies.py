"""Accelerate's ``DummyOptim`` / ``DummyScheduler``: stand-ins for the optimizer and scheduler a DeepSpeed config's
``optimizer`` / ``scheduler`` sections describe. ``Accelerator.prepare`` builds the real ones from the sections,
with the stand-ins' values filling the sections' "auto" params (an explicit value in the config wins), as
Accelerate does:

    optimizer = DummyOptim(model.parameters(), lr=3e-4)
    scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DeepSpeedConfigView", "DummyOptim", "DummyScheduler", "is_dummy_optimizer", "is_dummy_scheduler",
           "raw_deepspeed_config", "real_optimizer", "real_scheduler"]


class DummyOptim:
    """The optimizer of the DeepSpeed config's ``optimizer`` section, over ``params``.

    Args:
        params: the parameters (or parameter groups) to optimize.
        lr, weight_decay: fill the section's "auto" ``lr`` / ``weight_decay``.
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """The scheduler of the DeepSpeed config's ``scheduler`` section, over ``optimizer`` (a :class:`DummyOptim`).

    Args:
        total_num_steps: fills the section's "auto" ``total_num_steps`` (divided by the process count unless the
            Accelerator splits batches, as Accelerate does).
        warmup_num_steps: fills "auto" ``warmup_num_steps`` (at least 1).
        lr_scheduler_callable: without a ``scheduler`` section, ``callable(optimizer)`` builds the scheduler.
    """

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs


class DeepSpeedConfigView:
    """What ``AcceleratorState().deepspeed_plugin`` answers when the DeepSpeed config came as a dict, a file or
    ``accelerate launch``'s variables: Accelerate's ``deepspeed_config`` (the config as written, so that a script's
    ``"optimizer" in state.deepspeed_plugin.deepspeed_config`` picks DummyOptim as under Accelerate) and
    ``zero_stage``."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.deepspeed_config = dict(config)
        self.zero_stage = (config.get("zero_optimization") or {}).get("stage")

    def __repr__(self) -> str:
        return f"DeepSpeedConfigView(zero_stage={self.zero_stage!r})"


def is_dummy_optimizer(obj: Any) -> bool:
    """This module's DummyOptim or Accelerate's (read by name and attributes, as every reader here)."""
    return type(obj).__name__ == "DummyOptim" and hasattr(obj, "params") and hasattr(obj, "lr")


def is_dummy_scheduler(obj: Any) -> bool:
    return type(obj).__name__ == "DummyScheduler" and hasattr(obj, "optimizer")


def raw_deepspeed_config(config: Mapping[str, Any] | None, runner_config: Any) -> tuple[dict[str, Any], str] | None:
    """The DeepSpeed config as written (its "auto" values still open) and where it came from: ``config`` when the
    Accelerator built it, else the file ``shardkit launch --config_file`` handed the Runner; None without one."""
    if config is not None:
        return dict(config), "the DeepSpeed config"
    from shardkit.config.common import CONFIG_FILE_ENV, load_mapping

    file = os.environ.get(CONFIG_FILE_ENV)
    if runner_config is None or not file:
        return None
    path = Path(file)
    if path.suffix.lower() in (".yaml", ".yml"):
        from shardkit.config.accelerate import load_accelerate_config

        loaded = load_accelerate_config(path)
        return (dict(loaded.deepspeed), loaded.deepspeed_source) if loaded.deepspeed is not None else None
    return load_mapping(path), str(path)


def _auto(section: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The stand-in's values for the params the section leaves "auto" (an explicit value in the config wins)."""
    params = section.get("params") or {}
    return {k: v for k, v in values.items() if params.get(k) == "auto"}


def real_optimizer(dummy: Any, raw: tuple[dict[str, Any], str] | None) -> Any:
    """The torch optimizer the config's ``optimizer`` section describes, over the DummyOptim's parameters."""
    from shardkit.config.optim import build_optimizer, resolve_optimizer

    if raw is None or "optimizer" not in raw[0]:
        raise ValueError("prepare() got a DummyOptim but there is no DeepSpeed config with an optimizer section; "
                         "build a torch optimizer, or add the optimizer section to the DeepSpeed config")
    config, where = raw
    spec = resolve_optimizer(config["optimizer"], where,
                             _auto(config["optimizer"], {"lr": dummy.lr, "weight_decay": dummy.weight_decay}))
    return build_optimizer(spec, list(dummy.params))


def real_scheduler(dummy: Any, optimizer: Any, raw: tuple[dict[str, Any], str] | None, processes: int,
                   split_batches: bool) -> Any:
    """The scheduler the config's ``scheduler`` section describes (or ``lr_scheduler_callable(optimizer)``)."""
    from shardkit.config.optim import build_scheduler, resolve_scheduler

    section = raw[0].get("scheduler") if raw is not None else None
    if section is None:
        if dummy.lr_scheduler_callable is None:
            raise ValueError("prepare() got a DummyScheduler but the DeepSpeed config has no scheduler section; add "
                             "one, or pass DummyScheduler(lr_scheduler_callable=...)")
        return dummy.lr_scheduler_callable(optimizer)
    if dummy.lr_scheduler_callable is not None:
        raise ValueError("DummyScheduler(lr_scheduler_callable=...) and the DeepSpeed config's scheduler section "
                         "both describe the scheduler; keep one")
    values: dict[str, Any] = {"warmup_min_lr": 0, "warmup_max_lr": optimizer.defaults["lr"],
                              "warmup_num_steps": max(1, int(dummy.warmup_num_steps))}
    if dummy.total_num_steps is not None:
        total = int(dummy.total_num_steps)
        values["total_num_steps"] = total if split_batches else math.ceil(total / processes)
    config, where = raw
    spec = resolve_scheduler(section, where, _auto(section, values), optimizer.defaults["lr"])
    return build_scheduler(spec, optimizer)
