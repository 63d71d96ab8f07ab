"""Learning-rate schedules by Hugging Face's names, with warmup; plain LambdaLR so the Runner saves them."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

__all__ = ["get_scheduler", "is_metric_driven"]


def _constant(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    return step / max(1, num_warmup_steps) if step < num_warmup_steps else 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))


def _cosine(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5,
            min_lr_rate: float = 0.0) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int = 1) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(step: int, *, num_warmup_steps: int, num_training_steps: int, lr_init: float, lr_end: float = 1e-7,
                power: float = 1.0) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init
    remaining = 1 - (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, num_training_steps: int, timescale: int | None = None) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    timescale = timescale or (num_warmup_steps or 10_000)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((step + shift) / timescale)


def _warmup_stable_decay(step: int, *, num_warmup_steps: int, num_training_steps: int, num_decay_steps: int,
                         num_stable_steps: int, min_lr_ratio: float = 0.0, decay_type: str = "cosine",
                         num_cycles: float = 0.5) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = (step - num_warmup_steps - num_stable_steps) / max(1, num_decay_steps)
        if decay_type == "linear":
            value = 1.0 - progress
        elif decay_type == "1-sqrt":
            value = 1.0 - math.sqrt(progress)
        else:
            value = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        return max(0.0, value) * (1.0 - min_lr_ratio) + min_lr_ratio
    return min_lr_ratio


def _cosine_warmup_with_min_lr(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5,
                               min_lr_rate: float = 0.0, warmup_lr_rate: float | None = None) -> float:
    # Hugging Face's "cosine_warmup_with_min_lr": the warmup starts above 0 and the cosine ends at min_lr exactly
    # on the last step (the +1 shifts), unlike "cosine_with_min_lr".
    if step < num_warmup_steps:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, num_warmup_steps)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, num_warmup_steps - 1)
    progress = (step - num_warmup_steps + 1.0) / max(1.0, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)


_SCHEDULES = {
    "constant": _constant, "constant_with_warmup": _constant_with_warmup, "linear": _linear, "cosine": _cosine,
    "cosine_with_restarts": _cosine_with_restarts, "polynomial": _polynomial, "inverse_sqrt": _inverse_sqrt,
    "cosine_with_min_lr": _cosine, "warmup_stable_decay": _warmup_stable_decay,
    "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr,
}
_METRIC_DRIVEN = ("reduce_lr_on_plateau", "greedy")


def _special_kwargs(name: str, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any], warmup: int,
                    total: int) -> dict[str, Any]:
    kwargs = dict(kwargs)
    base_lr = optimizer.defaults.get("lr", optimizer.param_groups[0]["lr"])
    if name == "polynomial":
        kwargs["lr_init"] = base_lr
        kwargs.setdefault("lr_end", 1e-7)
        kwargs.setdefault("power", 1.0)
        if not kwargs["lr_end"] < base_lr:
            raise ValueError(f"lr_scheduler_kwargs lr_end={kwargs['lr_end']} must be below learning_rate={base_lr}")
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        if ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise ValueError(f"lr_scheduler_type={name!r} needs exactly one of min_lr or min_lr_rate in "
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

    ``reduce_lr_on_plateau`` returns torch's ReduceLROnPlateau and ``greedy`` transformers' GreedyLR, which the
    Trainer steps after each evaluation with ``metric_for_best_model``; every other name is a LambdaLR stepped
    once per optimizer step (its ``lr_lambdas[0]`` is a partial with Hugging Face's keyword names).
    """
    kwargs = dict(scheduler_specific_kwargs or {})
    name = str(name.value if hasattr(name, "value") else name)
    if name == "reduce_lr_on_plateau":
        return ReduceLROnPlateau(optimizer, **kwargs)
    if name == "greedy":
        return _greedy(optimizer, kwargs)
    if name not in _SCHEDULES:
        valid = sorted([*_SCHEDULES, *_METRIC_DRIVEN])
        raise ValueError(f"unknown lr_scheduler_type {name!r}; use one of {valid}")
    fn = _SCHEDULES[name]
    kwargs = _special_kwargs(name, optimizer, kwargs, num_warmup_steps, num_training_steps)
    accepted = set(inspect.signature(fn).parameters) - {"step", "num_warmup_steps", "num_training_steps"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"lr_scheduler_kwargs {unknown} are not used by lr_scheduler_type={name!r}; "
                         f"it takes {sorted(accepted)}")
    schedule = functools.partial(fn, num_warmup_steps=num_warmup_steps, num_training_steps=num_training_steps,
                                 **kwargs)
    return LambdaLR(optimizer, schedule)


def _greedy(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> Any:
    try:
        from transformers.optimization import GreedyLR
    except ImportError as err:
        raise ValueError("lr_scheduler_type='greedy' is transformers' GreedyLR: pip install transformers (or pick "
                         "'reduce_lr_on_plateau', which also steps on the eval metric)") from err
    return GreedyLR(optimizer, **kwargs)


def is_metric_driven(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` takes the evaluation metric (ReduceLROnPlateau, GreedyLR, a user's own): the
    Trainer steps such a scheduler after each evaluation with ``metric_for_best_model``, not per step."""
    step = getattr(scheduler, "step", None)
    if step is None:
        return False
    try:
        params = inspect.signature(step).parameters
    except (TypeError, ValueError):
        return False
    return "metrics" in params or isinstance(scheduler, ReduceLROnPlateau)
