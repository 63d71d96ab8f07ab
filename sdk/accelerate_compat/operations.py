"""Accelerate's collective helpers (``accelerate.utils.operations``) on the shared strategy's collectives.

Every function takes a tensor or a nested list/tuple/dict of tensors and runs on every process. With
``PartialState().debug = True`` (Accelerate's operation checker) the shapes are compared across processes
first and a mismatch raises :class:`DistributedOperationException` naming each process's shape, instead of a
collective failing or hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardkit.accelerate_compat.state import PartialState, shared_strategy

__all__ = ["DistributedOperationException", "broadcast", "gather", "gather_object", "pad_across_processes",
           "recursively_apply", "reduce", "send_to_device", "synchronize_rng_states"]


class DistributedOperationException(RuntimeError):
    """A collective was asked of tensors whose shapes differ across processes (found by the operation checker)."""


def recursively_apply(func: Callable[[torch.Tensor], Any], data: Any, error_on_other_type: bool = False) -> Any:
    """Apply ``func`` to every tensor in nested lists, tuples (named ones too) and mappings of ``data``.

    Raises:
        TypeError: with ``error_on_other_type``, for a leaf that is not a tensor.
    """
    if isinstance(data, torch.Tensor):
        return func(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(recursively_apply(func, v, error_on_other_type) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(func, v, error_on_other_type) for v in data)
    if isinstance(data, Mapping):
        return type(data)({k: recursively_apply(func, v, error_on_other_type) for k, v in data.items()})
    if error_on_other_type:
        raise TypeError(f"expected tensors (or nested lists, tuples, dicts of them), got a {type(data).__name__}")
    return data


def _shapes(data: Any) -> Any:
    return recursively_apply(lambda t: list(t.shape), data)


def _check_same_shapes(operation: str, data: Any) -> None:
    """The operation checker: every process's shapes must be equal (one object gather; only in debug mode)."""
    state = PartialState()
    if not state.debug or state.num_processes == 1:
        return
    everyone = gather_object([_shapes(data)])
    if any(shapes != everyone[0] for shapes in everyone):
        listing = "\n  - ".join(f"Process {i}: {shapes}" for i, shapes in enumerate(everyone))
        raise DistributedOperationException(f"cannot {operation}: the shapes differ across processes; every process "
                                            f"must pass the same shapes.\nInput shapes:\n  - {listing}")


def gather(tensor: Any) -> Any:
    """Each tensor from every process, concatenated along the first dimension (0-d tensors become 1-d)."""
    _check_same_shapes("gather", tensor)
    strategy = shared_strategy()

    def one(t: torch.Tensor) -> torch.Tensor:
        # detached: a gather carries no gradient, and gloo's all_gather refuses a tensor that wants one
        t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
        return strategy.all_gather(t.contiguous()).reshape(-1, *t.shape[1:])

    return recursively_apply(one, tensor, error_on_other_type=True)


def gather_object(obj: Any) -> list[Any]:
    """Every process's ``obj`` on every process: lists concatenated in process order, other objects listed."""
    from shardkit.inference import gather_object as gather_objects

    strategy = shared_strategy()
    return gather_objects(obj, dp_rank=strategy.rank, dp_size=strategy.world_size)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every tensor takes ``from_process``'s values (in place; returned too)."""
    _check_same_shapes("broadcast", tensor)
    strategy = shared_strategy()
    return recursively_apply(lambda t: strategy.broadcast(t, from_process), tensor, error_on_other_type=True)


_REDUCTIONS = ("sum", "mean", "max", "min", "none")


def reduce(tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Each tensor reduced over the processes ("sum", "mean", "max", "min" or "none"), as a new tensor, times
    ``scale``."""
    if reduction not in _REDUCTIONS:
        from shardkit.utils.suggest import did_you_mean

        raise ValueError(f"reduction={reduction!r} is not one of {list(_REDUCTIONS)}"
                         f"{did_you_mean(str(reduction), _REDUCTIONS)}")
    _check_same_shapes("reduce", tensor)
    strategy = shared_strategy()

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        if reduction != "none":
            strategy.all_reduce(out, reduction)
        return out * scale if scale != 1.0 else out

    return recursively_apply(one, tensor, error_on_other_type=True)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the largest size any process has, with ``pad_index`` (at the end, or at the
    start with ``pad_first``), so that the tensors can be gathered."""
    state = PartialState()
    if state.debug and state.num_processes > 1:
        ranks = gather_object([recursively_apply(lambda t: t.dim(), tensor)])
        if any(r != ranks[0] for r in ranks):
            listing = "\n  - ".join(f"Process {i}: {r}" for i, r in enumerate(ranks))
            raise DistributedOperationException(f"cannot pad_across_processes: the number of dimensions differs "
                                                f"across processes.\nDimensions:\n  - {listing}")

    def one(t: torch.Tensor) -> torch.Tensor:
        if not -t.dim() <= dim < t.dim():
            return t
        axis = dim % t.dim()
        sizes = gather(torch.tensor(t.shape, device=t.device)[None]).cpu()
        longest = int(sizes[:, axis].max())
        if longest == t.shape[axis]:
            return t
        shape = list(t.shape)
        shape[axis] = longest
        out = t.new_full(shape, pad_index)
        start = longest - t.shape[axis] if pad_first else 0
        out.narrow(axis, start, t.shape[axis]).copy_(t)
        return out

    return recursively_apply(one, tensor, error_on_other_type=True)


def send_to_device(tensor: Any, device: torch.device | str, non_blocking: bool = False,
                   skip_keys: Any = None) -> Any:
    """Move every tensor of a (nested) batch to ``device``; other values pass through."""
    from shardkit.utils.operations import move_to_device

    if skip_keys:
        raise NotImplementedError("send_to_device(skip_keys=...) is not supported; move those entries yourself")
    return move_to_device(tensor, torch.device(device), non_blocking=non_blocking)


_RNG_TYPES = ("torch", "cuda", "generator")


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """Give every process the main process's RNG state of each kind ("torch", "cuda", "generator")."""
    strategy = shared_strategy()
    for kind in rng_types:
        if kind not in _RNG_TYPES:
            raise NotImplementedError(f"synchronize_rng_states: rng type {kind!r} is not supported here; use one of "
                                      f"{list(_RNG_TYPES)}")
        if kind == "torch":
            torch.set_rng_state(strategy.broadcast(torch.get_rng_state(), 0))
        elif kind == "cuda" and torch.cuda.is_available():
            state = torch.cuda.get_rng_state().to(strategy.root_device)
            torch.cuda.set_rng_state(strategy.broadcast(state, 0).cpu())
        elif kind == "generator" and generator is not None:
            generator.set_state(strategy.broadcast(generator.get_state(), 0))
