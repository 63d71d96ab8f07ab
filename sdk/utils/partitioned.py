"""Reading a parameter that a strategy's engine partitions in place, from code that bypasses its module.

An engine that partitions parameters in place (DeepSpeed ZeRO-3) gathers a module's parameters in hooks
around that module's forward. Code that reads a weight directly instead of calling its module (the fused
loss reads ``lm_head.weight`` without calling ``lm_head``) wraps the read in :func:`gathered_for_read`; the
strategy that partitions supplies, as a :class:`PartitionedParameters` handler, how to tell such a
parameter and how to gather it, so that the reading code never imports or names the engine.

:func:`params_partitioned` tells code outside the strategies (synced generation) whether a module's forward
is a collective, again without naming an engine. :func:`gathered_for_write` and :func:`full_shape` let code that
holds only the model (``load_state_dict_from_zero_checkpoint``) write whole values into such parameters, and
:func:`own_slice` lets a reader of weight files (``checkpoint/hf.py``) write each rank's own part straight into
its partition, with no gather.

It lives among the leaf helpers so that every package (``checkpoint`` too) can ask; it imports nothing of shardkit
when imported. A strategy whose engine partitions parameters names its handler in ``_HANDLERS`` below
("engine package=module:attribute"), imported on the first question about a parameter asked after the engine's
package was imported (no parameter is the engine's before), without importing the engine itself.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Protocol

from torch import Tensor, nn

__all__ = ["PartitionedParameters", "full_shape", "gathered_for_read", "gathered_for_write", "handlers",
           "own_slice", "params_partitioned"]


class PartitionedParameters(Protocol):
    """How one engine's partitioned parameters are recognised and gathered for a read."""

    def owns(self, param: Tensor) -> bool:
        """Whether ``param`` is one this engine partitions, gathered right now or not."""
        ...

    def is_partitioned(self, param: Tensor) -> bool:
        """Whether ``param`` is this engine's and not whole right now (nothing gathered it)."""
        ...

    def gathered_for_read(self, params: list[Tensor]) -> contextlib.AbstractContextManager:
        """Context in which ``params`` (all partitioned) are whole on every rank; nothing is written back."""
        ...

    def gathered_for_write(self, params: list[Tensor]) -> contextlib.AbstractContextManager:
        """Context in which ``params`` (all partitioned) are whole on every rank; on leaving it what the first rank
        holds is partitioned back on every rank."""
        ...

    def full_shape(self, param: Tensor) -> tuple[int, ...]:
        """The shape ``param`` has when whole."""
        ...

    def own_slice(self, param: Tensor) -> tuple[int, Tensor] | None:
        """This rank's own run of ``param``'s flattened whole values, when the engine keeps one run per rank and
        ``param`` is partitioned right now: ``(offset of the run's first element in the flattened whole, a flat
        view of the run, padding left out)``, writes into the view landing in the partition. None when this
        rank holds no such run (a parameter kept whole, gathered now, or held elsewhere, such as on NVMe): the
        caller gathers it instead."""
        ...


# "engine package=module:attribute": the handler is imported on the first question asked once the engine's package
# is imported; before that no parameter can be the engine's, and asking (every generate call under DDP does) costs
# no import of the strategy's modules.
_HANDLERS: list[str | PartitionedParameters] = ["deepspeed=shardkit.strategies.zero.stage3:ZERO3_PARAMETERS"]


def handlers() -> list[PartitionedParameters]:
    """The registered handlers whose engine is imported, each imported on first use."""
    for i, handler in enumerate(_HANDLERS):
        if isinstance(handler, str):
            engine, _, where = handler.rpartition("=")
            if engine and engine not in sys.modules:
                continue
            module, _, attr = where.partition(":")
            _HANDLERS[i] = getattr(importlib.import_module(module), attr)
    return [h for h in _HANDLERS if not isinstance(h, str)]


def gathered_for_read(*params: Tensor | None) -> contextlib.AbstractContextManager:
    """Gather, for the duration of the block and read-only, those of ``params`` an engine holds partitioned.

    Every rank must enter it with the same parameters (the gathers are collectives). Parameters no engine
    partitions (None, plain tensors, ones already gathered) are left as they are, and no engine is imported.
    """
    return _gathered(params, "gathered_for_read")


def gathered_for_write(*params: Tensor | None) -> contextlib.AbstractContextManager:
    """Gather, for the duration of the block, those of ``params`` an engine holds partitioned; what the first rank
    writes into them is kept on every rank when the block ends.

    Every rank must enter it with the same parameters and write the same values (the gathers and the scatter are
    collectives). Parameters no engine partitions are left as they are, and writes into them stay local.
    """
    return _gathered(params, "gathered_for_write")


@contextlib.contextmanager
def _gathered(params: tuple[Tensor | None, ...], how: str) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for handler in handlers():
            parts = [p for p in params if p is not None and handler.is_partitioned(p)]
            if parts:
                stack.enter_context(getattr(handler, how)(parts))
        yield


def full_shape(param: Tensor) -> tuple[int, ...]:
    """The shape of ``param`` when whole: an engine's partitioned placeholder has its own (``[0]``)."""
    for handler in handlers():
        if handler.owns(param):
            return handler.full_shape(param)
    return tuple(param.shape)


def own_slice(param: Tensor) -> tuple[int, Tensor] | None:
    """``(offset, flat view)`` of this rank's own run of a parameter an engine partitions (see
    :meth:`PartitionedParameters.own_slice`); None for any other parameter, or one whose run this rank cannot
    write into directly. Local: no collective."""
    for handler in handlers():
        if handler.owns(param):
            return handler.own_slice(param)
    return None


def params_partitioned(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` is split across ranks (a DTensor of FSDP2/TP, or a parameter an
    engine partitions in place, such as ZeRO-3's), so that its forward is a collective every rank must join."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    if any(isinstance(p, DTensor) for p in params):
        return True
    return any(handler.owns(p) for handler in handlers() for p in params)
