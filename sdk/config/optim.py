"""The optimizer and scheduler sections of a DeepSpeed config: checked, "auto" filled, and built.

The resolved sections keep DeepSpeed's names (``{"type": "AdamW", "params": {"lr": ..., "betas": ...}}``)
so that a Trainer, or a training loop, builds the same thing DeepSpeed would:
``build_optimizer(resolved.optimizer, model.parameters())``, ``build_scheduler(resolved.scheduler, opt)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shardkit.config.common import ConfigError, check_known_keys, check_number, reconcile
from shardkit.config.deepspeed_schema import OPTIMIZER_PARAMS, SCHEDULER_PARAMS, UNSUPPORTED_OPTIMIZERS
from shardkit.utils.suggest import did_you_mean

__all__ = ["build_optimizer", "build_scheduler", "resolve_optimizer", "resolve_scheduler"]

_CANONICAL = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "adagrad": "Adagrad"}
# Filled in for "auto" when nothing else supplied a value: torch.optim.AdamW's defaults, DeepSpeed's for the
# schedulers (warmup_num_steps=1000, log warmup), and the optimizer's lr as the warmup target.
_OPTIMIZER_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "momentum": 0.0}
_NONNEG, _POSITIVE, _FRACTION = dict(minimum=0), dict(above=0), dict(minimum=0, maximum=1)
_STEPS, _POSITIVE_STEPS = dict(integer=True, minimum=0), dict(integer=True, minimum=1)
# The range of every numeric param, checked as the config is read: unchecked, "abc" or -1 for lr failed only when
# the optimizer was built, after the model had been set up.
_PARAM_RANGES: dict[str, dict[str, Any]] = {
    "lr": _NONNEG, "eps": _POSITIVE, "weight_decay": _NONNEG, "momentum": _NONNEG, "dampening": _NONNEG,
    "lr_decay": _NONNEG, "initial_accumulator_value": _NONNEG,
    "warmup_min_lr": _NONNEG, "warmup_max_lr": _NONNEG, "warmup_num_steps": _POSITIVE_STEPS,
    "total_num_steps": _POSITIVE_STEPS, "warmup_min_ratio": _FRACTION, "cos_min_ratio": _FRACTION,
    "last_batch_iteration": dict(integer=True, minimum=-1), "cycle_min_lr": _NONNEG, "cycle_max_lr": _NONNEG,
    "decay_lr_rate": _NONNEG, "cycle_first_step_size": _POSITIVE_STEPS, "cycle_second_step_size": _POSITIVE_STEPS,
    "cycle_first_stair_count": _STEPS, "cycle_second_stair_count": _STEPS, "decay_step_size": _STEPS,
    "cycle_min_mom": _FRACTION, "cycle_max_mom": _FRACTION, "decay_mom_rate": _NONNEG,
    "lr_range_test_min_lr": _NONNEG, "lr_range_test_step_size": _POSITIVE_STEPS, "lr_range_test_step_rate": _POSITIVE,
}
_SCHEDULER_DEFAULTS = {"warmup_min_lr": 0.0, "warmup_num_steps": 1000, "warmup_type": "log",
                       "warmup_min_ratio": 0.0, "cos_min_ratio": 1e-4}


def resolve_optimizer(section: Mapping[str, Any] | None, where: str,
                      values: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """``{"type", "params"}`` with every "auto" param filled from ``values`` (else a documented default).

    An explicit param that disagrees with an explicit entry of ``values`` raises ConfigMismatchError.
    """
    if section is None:
        return None
    values = dict(values or {})
    name = str(section.get("type", ""))
    key = name.lower()
    if key in UNSUPPORTED_OPTIMIZERS:
        raise NotImplementedError(f"optimizer.type={name!r} in {where} is not supported by shardkit; use one of "
                                  f"{sorted(_CANONICAL.values())}")
    if key not in OPTIMIZER_PARAMS:
        raise ConfigError(f"optimizer.type={name!r} in {where} is not a known optimizer"
                          f"{did_you_mean(name, _CANONICAL.values())}; use one of "
                          f"{sorted(_CANONICAL.values())}")
    params = dict(section.get("params") or {})
    check_known_keys(params, OPTIMIZER_PARAMS[key], "optimizer.params", where)
    check_known_keys(values, OPTIMIZER_PARAMS[key], "optimizer_params", "the Runner's optimizer values")
    for param in sorted(set(params) | set(values)):
        value = reconcile(f"optimizer.params.{param}", params.get(param), where, values.get(param),
                          "Runner(optimizer_params=...)")
        params[param] = value if value is not None else _default(param, key)
    _check_ranges(params, "optimizer.params", where)
    return {"type": _CANONICAL[key], "params": params}


def _check_ranges(params: Mapping[str, Any], path: str, where: str) -> None:
    """Every numeric param in its range; betas two numbers in [0, 1)."""
    for name, value in params.items():
        dotted = f"{path}.{name}"
        if name in _PARAM_RANGES and not (value is None and name == "cycle_second_step_size"):
            check_number(value, dotted, where, **_PARAM_RANGES[name])
        if name == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                raise ConfigError(f"{dotted}={value!r} in {where} must be two numbers like [0.9, 0.999]")
            for index, beta in enumerate(value):
                check_number(beta, f"{dotted}[{index}]", where, minimum=0)
                if beta >= 1:
                    raise ConfigError(f"{dotted}[{index}]={beta!r} in {where} must be < 1 (like 0.9 or 0.999)")


def _default(param: str, optimizer: str) -> Any:
    if param == "weight_decay" and optimizer in ("adam", "sgd", "adagrad"):
        return 0.0
    if param not in _OPTIMIZER_DEFAULTS:
        raise ConfigError(f"optimizer.params.{param} is 'auto' and nothing supplies it; write a value")
    return _OPTIMIZER_DEFAULTS[param]


def resolve_scheduler(section: Mapping[str, Any] | None, where: str, values: Mapping[str, Any] | None = None,
                      lr: float | None = None) -> dict[str, Any] | None:
    """``{"type", "params"}`` with "auto" params filled from ``values``, then DeepSpeed's defaults.

    ``warmup_max_lr`` "auto" becomes the optimizer's ``lr``; ``total_num_steps`` "auto" must be supplied.
    """
    if section is None:
        return None
    values = dict(values or {})
    name = str(section.get("type", ""))
    if name not in SCHEDULER_PARAMS:
        raise ConfigError(f"scheduler.type={name!r} in {where} is not a DeepSpeed scheduler"
                          f"{did_you_mean(name, SCHEDULER_PARAMS)}; use one of {sorted(SCHEDULER_PARAMS)}")
    params = dict(section.get("params") or {})
    check_known_keys(params, SCHEDULER_PARAMS[name], "scheduler.params", where)
    check_known_keys(values, SCHEDULER_PARAMS[name], "scheduler_params", "the Runner's scheduler values")
    if values.get("warmup_num_steps") is not None:
        # NOTE: as transformers fills it: DeepSpeed 0.19.6+ refuses 0 ("warmup_num_steps must be a positive
        # integer"), so a run without warmup (the Trainer's default warmup_steps=0) gets one step.
        values["warmup_num_steps"] = max(1, int(values["warmup_num_steps"]))
    for param in sorted(set(params) | set(values)):
        value = reconcile(f"scheduler.params.{param}", params.get(param), where, values.get(param),
                          "Runner(scheduler_params=...)")
        if value is None and param == "warmup_max_lr":
            value = lr if lr is not None else _OPTIMIZER_DEFAULTS["lr"]
        if value is None and param in _SCHEDULER_DEFAULTS:
            value = _SCHEDULER_DEFAULTS[param]
        if value is None:
            raise ConfigError(f"scheduler.params.{param} is 'auto' in {where} and nothing supplies it; write a "
                              f"value or pass it in scheduler_params")
        params[param] = value
    _check_ranges(params, "scheduler.params", where)
    return {"type": name, "params": params}


def build_optimizer(spec: Mapping[str, Any], params: Iterable[Any]):
    """A torch optimizer for a resolved optimizer section.

    NOTE: DeepSpeed's "Adam" decouples weight decay (``adam_w_mode`` defaults to true), so it builds AdamW
    unless ``adam_w_mode`` is false. DeepSpeed-only switches (torch_adam, fused, bias_correction) are dropped.
    """
    from shardkit.optim import create_optimizer

    kind, kwargs = spec["type"].lower(), dict(spec["params"])
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    for key in ("torch_adam", "fused", "bias_correction"):
        kwargs.pop(key, None)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    name = {"adamw": "adamw_torch", "adam": "adamw_torch" if adam_w_mode else "adam_torch", "sgd": "sgd"}.get(kind)
    if name is None:
        import torch

        return torch.optim.Adagrad(params, **kwargs)
    return create_optimizer(name, params, **kwargs)


def build_scheduler(spec: Mapping[str, Any], optimizer: Any):
    """DeepSpeed's own scheduler class (deepspeed.runtime.lr_schedules) for a resolved scheduler section.

    The returned object is stepped once per optimizer step, as the Runner does. DeepSpeed is imported by the
    ZeRO package, not here (:func:`shardkit.strategies.zero.schedulers.deepspeed_scheduler`).
    """
    from shardkit.strategies.zero.schedulers import deepspeed_scheduler

    return deepspeed_scheduler(spec, optimizer)
