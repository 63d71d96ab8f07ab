"""How :class:`shardkit.Accelerator` is composed: :class:`Prepared`, what it prepared (its models, optimizers,
schedulers and data loaders, in order, and the model each prepared optimizer was set up with), which its parts
(training, checkpoints) are handed; and :func:`forward_to` / :func:`part_attribute`, which make Accelerate's
methods and attributes on the Accelerator those of the part that owns them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["Prepared", "forward_to", "part_attribute"]


def forward_to(part: str, function: Callable) -> Callable:
    """A method whose call is ``function`` of the instance's attribute ``part`` (same name, signature and docstring,
    so ``help()`` and ``inspect.signature`` read as before)."""

    @functools.wraps(function)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return function(getattr(self, part), *args, **kwargs)

    return method


def part_attribute(part: str, name: str, doc: str | None = None, settable: bool = False) -> property:
    """A property that is attribute ``name`` of the instance's attribute ``part`` (assignable when ``settable``)."""

    def get(self: Any) -> Any:
        return getattr(getattr(self, part), name)

    def set_(self: Any, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, set_ if settable else None, doc=doc)


class Prepared:
    """The prepared objects, in the order ``prepare`` returned them (checkpoint entries are named by that order)."""

    def __init__(self) -> None:
        self.models: list[nn.Module] = []
        self.optimizers: list[Any] = []  # AcceleratedOptimizer
        self.schedulers: list[Any] = []  # AcceleratedScheduler
        self.dataloaders: list[Any] = []  # PreparedDataLoader
        self._owners: dict[int, nn.Module] = {}  # id(prepared optimizer) -> its prepared model

    def add_optimizer(self, optimizer: Any, model: nn.Module) -> None:
        """A prepared optimizer and the prepared model whose parameters it steps."""
        self.optimizers.append(optimizer)
        self._owners[id(optimizer)] = model

    def owner_of(self, optimizer: Any) -> nn.Module:
        """The prepared model of a prepared optimizer."""
        model = self._owners.get(id(optimizer))
        if model is None:
            raise ValueError("this optimizer was not prepared by this Accelerator: pass it to accelerator.prepare() "
                             "together with its model")
        return model

    def clear(self) -> None:
        """Forget everything prepared (``free_memory``)."""
        for kept in (self.models, self.optimizers, self.schedulers, self.dataloaders):
            kept.clear()
        self._owners.clear()
