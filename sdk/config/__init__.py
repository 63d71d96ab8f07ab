"""DeepSpeed JSON and Accelerate YAML configs, accepted as they are and checked key by key.

    resolved = resolve_runner_config("ds_config.json", gradient_accumulation_steps=4)
    Runner(strategy=resolved.strategy, precision=resolved.precision, ...)

A ``.json`` path (or a dict) is a DeepSpeed config; ``.yaml``/``.yml`` is an Accelerate config.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardkit.config.common import (
    CONFIG_FILE_ENV,
    ConfigError,
    ConfigKeyError,
    ConfigMismatchError,
    ConfigResourceError,
    ResolvedConfig,
)

__all__ = ["CONFIG_FILE_ENV", "ConfigError", "ConfigKeyError", "ConfigMismatchError", "ConfigResourceError",
           "ResolvedConfig", "resolve_runner_config"]

log = logging.getLogger("shardkit.config")
_LOGGED: set[str] = set()


def resolve_runner_config(
    config: str | os.PathLike | Mapping[str, Any], *, strategy: Any = None, precision: Any = None,
    gradient_accumulation_steps: int | None = None, micro_batch_size: int | None = None,
    max_grad_norm: float | None = None, world_size: int | None = None,
    optimizer_params: Mapping[str, Any] | None = None, scheduler_params: Mapping[str, Any] | None = None,
    explicit_precision_wins: bool = False, source: str | None = None,
) -> ResolvedConfig:
    """What a config asks of a Runner, with "auto" filled from the Runner's explicit values.

    Args:
        config: a DeepSpeed ``.json`` path or dict, or an Accelerate ``.yaml``/``.yml`` path.
        strategy, precision, gradient_accumulation_steps, micro_batch_size, max_grad_norm: the Runner's
            explicit arguments; None means not given. A value set both here and in the file must agree.
        world_size: data-parallel processes for the batch-size check (default: WORLD_SIZE, else the file's
            num_processes, else 1).
        optimizer_params, scheduler_params: values for "auto" optimizer/scheduler params (lr, warmup_num_steps ...).
        explicit_precision_wins: the config came from the launcher (``shardkit launch --config_file``): an explicit
            ``precision`` overrides an Accelerate YAML's ``mixed_precision`` with one warning instead of disagreeing.
        source: how errors name a DeepSpeed config given as a dict (default "the DeepSpeed config dict").

    Raises:
        ConfigKeyError: an unknown key (dotted path and the closest valid key).
        ConfigMismatchError: the file and the Runner disagree (both values and where each came from).
        ConfigResourceError: more processes or machines than exist.
        ConfigError: any other impossible value or combination.
        NotImplementedError: a key that changes training and that shardkit cannot honour.
    """
    kwargs = dict(strategy=strategy, precision=precision, gradient_accumulation_steps=gradient_accumulation_steps,
                  micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm, world_size=world_size,
                  optimizer_params=optimizer_params, scheduler_params=scheduler_params)
    if isinstance(config, Mapping):
        from shardkit.config.deepspeed import resolve_deepspeed

        return _logged(resolve_deepspeed(config, source=source, **kwargs))
    suffix = Path(config).suffix.lower()
    if suffix == ".json":
        from shardkit.config.deepspeed import resolve_deepspeed

        return _logged(resolve_deepspeed(config, **kwargs))
    if suffix in (".yaml", ".yml"):
        from shardkit.config.accelerate import resolve_accelerate

        return _logged(resolve_accelerate(config, explicit_precision_wins=explicit_precision_wins, **kwargs))
    raise ConfigError(f"config {str(config)!r}: use a DeepSpeed .json file (or dict) or an Accelerate .yaml/.yml file")


def _logged(resolved: ResolvedConfig) -> ResolvedConfig:
    """Log what the config resolved to (every "auto" settled), once per source, on the main process only."""
    rank = os.environ.get("RANK", "0").strip()
    if rank in ("", "0") and resolved.source not in _LOGGED:
        _LOGGED.add(resolved.source)
        settings = getattr(resolved.strategy, "settings", None)
        # NOTE: the class name, not repr(): a strategy's repr may need the device, known only after setup.
        log.info("%s resolves to strategy=%s%s precision=%r gradient_accumulation_steps=%d micro_batch_size=%s "
                 "max_grad_norm=%s optimizer=%s scheduler=%s activation_checkpointing=%s", resolved.source,
                 type(resolved.strategy).__name__,
                 f" ({settings})" if settings is not None else "", resolved.precision,
                 resolved.gradient_accumulation_steps, resolved.micro_batch_size, resolved.max_grad_norm,
                 resolved.optimizer, resolved.scheduler, resolved.activation_checkpointing)
    return resolved
