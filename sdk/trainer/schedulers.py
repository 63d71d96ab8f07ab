"""Learning-rate schedules by Hugging Face's names, with warmup; plain LambdaLR so the Runner saves them."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

__all__ = ["get_scheduler"]


def _constant(step: int, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, warmup: int, total: int) -> float:
    return step / max(1, warmup) if step < warmup else 1.0


def _linear(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, warmup: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step: int, warmup: int, total: int, num_cycles: int = 1) -> float:
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(step: int, warmup: int, total: int, lr_init: float, lr_end: float = 1e-7, power: float = 1.0) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if step > total:
        return lr_end / lr_init
    remaining = 1 - (step - warmup) / max(1, total - warmup)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, warmup: int, total: int, timescale: int | None = None) -> float:
    if step < warmup:
        return step / max(1, warmup)
    timescale = timescale or (warmup or 10_000)
    shift = timescale - warmup
    return 1.0 / math.sqrt((step + shift) / timescale)


def _warmup_stable_decay(step: int, warmup: int, total: int, num_decay_steps: int, num_stable_steps: int,
                         min_lr_ratio: float = 0.0, decay_type: str = "cosine", num_cycles: float = 0.5) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if step < warmup + num_stable_steps:
        return 1.0
    if step < warmup + num_stable_steps + num_decay_steps:
        progress = (step - warmup - num_stable_steps) / max(1, num_decay_steps)
        if decay_type == "linear":
            value = 1.0 - progress
        elif decay_type == "1-sqrt":
            value = 1.0 - math.sqrt(progress)
        else:
            value = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        return max(0.0, value) * (1.0 - min_lr_ratio) + min_lr_ratio
    return min_lr_ratio


_SCHEDULES = {
    "constant": _constant, "constant_with_warmup": _constant_with_warmup, "linear": _linear, "cosine": _cosine,
    "cosine_with_restarts": _cosine_with_restarts, "polynomial": _polynomial, "inverse_sqrt": _inverse_sqrt,
    "cosine_with_min_lr": _cosine, "warmup_stable_decay": _warmup_stable_decay,
}


def _special_kwargs(name: str, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any], warmup: int,
                    total: int) -> dict[str, Any]:
    kwargs = dict(kwargs)
    base_lr = optimizer.defaults.get("lr", optimizer.param_groups[0]["lr"])
    if name == "polynomial":
        kwargs["lr_init"] = base_lr
        if kwargs.get("lr_end", 1e-7) > base_lr:
            raise ValueError(f"lr_scheduler_kwargs lr_end={kwargs['lr_end']} must be <= learning_rate={base_lr}")
    if name == "cosine_with_min_lr":
        if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise ValueError("lr_scheduler_type='cosine_with_min_lr' needs exactly one of min_lr or min_lr_rate in "
                             "lr_scheduler_kwargs, e.g. {'min_lr_rate': 0.1}")
        if "min_lr" in kwargs:
            kwargs["min_lr_rate"] = kwargs.pop("min_lr") / base_lr
    if name == "warmup_stable_decay":
        if "num_decay_steps" not in kwargs:
            raise ValueError("lr_scheduler_type='warmup_stable_decay' needs lr_scheduler_kwargs={'num_decay_steps': N}")
        kwargs.setdefault("num_stable_steps", max(0, total - warmup - kwargs["num_decay_steps"]))
    return kwargs


def get_scheduler(name: str, optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0,
                  num_training_steps: int = 0, scheduler_specific_kwargs: dict[str, Any] | None = None) -> Any:
    """The schedule ``name`` (Hugging Face's ``lr_scheduler_type`` names) over ``optimizer``.

    ``reduce_lr_on_plateau`` returns torch's ReduceLROnPlateau, which the Trainer steps after each
    evaluation with ``metric_for_best_model``; every other name is a LambdaLR stepped once per optimizer step.
    """
    kwargs = dict(scheduler_specific_kwargs or {})
    if name == "reduce_lr_on_plateau":
        return ReduceLROnPlateau(optimizer, **kwargs)
    if name not in _SCHEDULES:
        valid = sorted([*_SCHEDULES, "reduce_lr_on_plateau"])
        raise ValueError(f"unknown lr_scheduler_type {name!r}; use one of {valid}")
    fn = _SCHEDULES[name]
    kwargs = _special_kwargs(name, optimizer, kwargs, num_warmup_steps, num_training_steps)
    accepted = set(inspect.signature(fn).parameters) - {"step", "warmup", "total"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"lr_scheduler_kwargs {unknown} are not used by lr_scheduler_type={name!r}; "
                         f"it takes {sorted(accepted)}")
    schedule = functools.partial(fn, warmup=num_warmup_steps, total=num_training_steps, **kwargs)
    return LambdaLR(optimizer, schedule)
