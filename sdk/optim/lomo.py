"""LOMO and AdaLomo by name (``optim="lomo"`` / ``"adalomo"``): optimizers that update inside backward.

Neither has a ``step()`` that does the work: the update runs from per-parameter hooks during
``optimizer.fused_backward(loss, lr)`` (after ``optimizer.grad_norm(loss)`` when the gradient norm is
clipped). The Trainer drives them (:mod:`shardkit.trainer.backward_step`); their ``step()`` is a no-op.

- ``lomo``: lomo-optim's ``Lomo`` (the package is needed: ``pip install shardkit[optimizers]``).
- ``adalomo``: :class:`shardkit.optim.adalomo.AdaLomo`, our device-aware transcription of lomo-optim's
  AdaLomo (the package's hard-codes ``.cuda()``), so no package is needed and it runs on a CPU too.

From the Trainer, ``max_grad_norm > 0`` becomes the optimizer's ``clip_grad_norm`` (HF's Trainer gives
these optimizers no ``clip_grad_norm``, and its clipping after backward finds no gradient left, so there
it does nothing); the norm costs one extra backward per step, so ``max_grad_norm=0`` is the fast setting.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim import Optimizer

from .adalomo import AdaLomo
from .named import MissingOptimizerPackage
from .registry import register_optimizer

__all__ = ["is_fused_backward", "lomo_class"]

logger = logging.getLogger("shardkit.optim")

_EXTRA_HINT = "pip install shardkit[optimizers]"


def is_fused_backward(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` updates inside ``fused_backward(loss, lr)`` (LOMO, AdaLomo) instead of ``step()``."""
    return callable(getattr(optimizer, "fused_backward", None))


class _ParameterSet:
    """What lomo-optim's ``Lomo(model)`` reads from a model: ``named_parameters()`` and ``parameters()``,
    over the parameters it is given (so frozen parameters and param groups work as with any optimizer)."""

    def __init__(self, params: list[torch.Tensor]):
        self._given = params

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        return ((str(i), p) for i, p in enumerate(self._given))

    def parameters(self, *args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
        return iter(self._given)


@functools.cache
def lomo_class() -> type[Optimizer]:
    """lomo-optim's ``Lomo`` with a no-op ``step()`` and a ``grad_norm()`` that returns the total norm.

    Raises:
        MissingOptimizerPackage: lomo-optim is not installed (the message names it and the extra).
    """
    try:
        package = importlib.import_module("lomo_optim")
    except ImportError as err:
        raise MissingOptimizerPackage(f"optim='lomo' needs the package 'lomo-optim' (import lomo_optim), which is "
                                      f"not installed: {_EXTRA_HINT} (or pip install lomo-optim)") from err

    class Lomo(package.Lomo):
        """lomo-optim's LOMO: plain SGD applied from gradient hooks during ``fused_backward``.

        ``grad_reducer`` (set by the Trainer under DDP) averages each gradient across ranks as soon as it
        is accumulated: the package's hooks use a parameter's gradient only later (from the next
        parameter's hook, or after backward), so they see the average.
        """

        def __init__(self, model: Any, *args: Any, **kwargs: Any):
            super().__init__(model, *args, **kwargs)
            self.grad_reducer: Any = None
            self._reduce_handles = [p.register_post_accumulate_grad_hook(self._reduce)
                                    for _, p in model.named_parameters() if p.requires_grad]

        def _reduce(self, p: torch.Tensor) -> None:
            if self.grad_reducer is not None:
                self.grad_reducer(p.grad)

        def step(self, closure: Any = None) -> Any:
            return closure() if closure is not None else None  # the update ran inside fused_backward

        def grad_norm(self, loss: torch.Tensor) -> torch.Tensor | None:
            super().grad_norm(loss)
            norms = self.grad_norms
            return torch.norm(norms, 2.0) if isinstance(norms, torch.Tensor) else None

    Lomo.__module__ = __name__
    return Lomo


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    return items if items and isinstance(items[0], dict) else [{"params": items}]


def _clip_from(training_args: Any, kwargs: dict[str, Any]) -> None:
    if training_args is not None and training_args.max_grad_norm and training_args.max_grad_norm > 0:
        kwargs.setdefault("clip_grad_norm", float(training_args.max_grad_norm))


def _lomo(params: Iterable[Any], *, training_args: Any = None, **kwargs: Any) -> Optimizer:
    cls = lomo_class()
    groups = _groups(params)
    decays = {float(g.get("weight_decay", kwargs.get("weight_decay", 0.0))) for g in groups}
    if len(decays) > 1:
        # The package has one weight decay for every parameter; HF's Trainer gives it none at all.
        logger.warning("optim='lomo' applies one weight_decay to every parameter (lomo-optim has no param groups): "
                       "using %s for all, biases and norm weights included", max(decays))
    if decays:
        kwargs.setdefault("weight_decay", max(decays))
    _clip_from(training_args, kwargs)
    return cls(_ParameterSet([p for g in groups for p in g["params"]]), **kwargs)


def _adalomo(params: Iterable[Any], *, training_args: Any = None, **kwargs: Any) -> Optimizer:
    _clip_from(training_args, kwargs)
    return AdaLomo(params, **kwargs)


register_optimizer("lomo", _lomo)
register_optimizer("adalomo", _adalomo)
