"""Optimizers by name, for the Trainer and configs: ``create_optimizer("adamw_shardkit", model.parameters())``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from shardkit.utils.suggest import did_you_mean

from .adamw import FusedAdamW
from .named import NAMED_FACTORIES

__all__ = ["available_optimizers", "create_optimizer", "register_optimizer"]

OptimizerFactory = Callable[..., Optimizer]


def _adamw_foreach(params: Iterable[Any], **kwargs: Any) -> Optimizer:
    return torch.optim.AdamW(params, foreach=True, **kwargs)


def _adamw_fused(params: Iterable[Any], **kwargs: Any) -> Optimizer:
    return torch.optim.AdamW(params, fused=True, **kwargs)


_REGISTRY: dict[str, OptimizerFactory] = {
    "adamw_shardkit": FusedAdamW,  # ours: fused C++ on CPU, Triton on GPU, fp32 master weights for 16-bit params
    "adamw_torch": torch.optim.AdamW,
    "adamw_torch_foreach": _adamw_foreach,
    "adamw_torch_fused": _adamw_fused,
    "adam_torch": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "adafactor": torch.optim.Adafactor,
    **NAMED_FACTORIES,  # GaLore, GrokAdamW, schedule-free: their packages are imported when built
}


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def available_optimizers() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def register_optimizer(name: str, factory: OptimizerFactory, *, overwrite: bool = False) -> None:
    """Register ``factory(params, **kwargs) -> Optimizer`` under ``name`` (lower case, ``-`` read as ``_``)."""
    key = _normalize(name)
    if key in _REGISTRY and not overwrite:
        raise ValueError(f"optimizer {key!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[key] = factory


def _context_for(factory: OptimizerFactory, context: Mapping[str, Any] | None) -> dict[str, Any]:
    """The entries of ``context`` that ``factory`` names as keyword parameters (``model``, ``training_args``...)."""
    if not context:
        return {}
    try:
        named = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature takes none of them
        return {}
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {k: v for k, v in context.items() if k in named and named[k].kind in kinds}


def create_optimizer(name: str, params: Iterable[Any], *, context: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> Optimizer:
    """Build the optimizer registered as ``name`` over ``params`` (tensors or param groups).

    Args:
        name: one of :func:`available_optimizers` (case-insensitive, ``-`` read as ``_``).
        params: what a torch optimizer takes.
        context: what some factories need besides params, given to a factory only when its signature
            names the key: the Trainer passes ``model``, ``training_args`` and ``optim_target_modules``
            (a factory registered with ``def make(params, *, model, **kwargs)`` receives the model).
        **kwargs: passed to the optimizer (``lr``, ``weight_decay``, ``betas`` ...).

    Raises:
        ValueError: unknown name; the message names the closest valid one and lists all.
    """
    key = _normalize(name)
    factory = _REGISTRY.get(key)
    if factory is None:
        raise ValueError(f"unknown optimizer {name!r}{did_you_mean(key, _REGISTRY)} Valid names: "
                         f"{', '.join(available_optimizers())}")
    try:
        return factory(params, **_context_for(factory, context), **kwargs)
    except TypeError as err:
        if "unexpected keyword argument" not in str(err):
            raise
        raise TypeError(f"optimizer {key!r} does not take one of {sorted(kwargs)} ({err}): drop it from optim_args "
                        "(TrainingArguments) or the keyword arguments") from err
