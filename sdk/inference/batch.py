"""Data-parallel batch inference: split a list of inputs across ranks, gather the outputs back in order.

    with split_between_processes(prompts, apply_padding=True) as mine:
        outputs = [answer(p) for p in mine]
        everything = gather_object(outputs)      # len(prompts) outputs, in the prompts' order

Ranks of one tensor-parallel group (same data-parallel rank) get the same items; the gather keeps
one copy per group. With ``apply_padding`` every rank gets the same number of items (short ranks
repeat their last one), which keeps batch shapes equal and, under ZeRO-3/FSDP/TP, the number of
``runner.generate`` calls equal on every rank (each call is collective); the gather inside the
``with`` block drops those duplicates again. Without padding, pass each rank's share to one
``runner.generate`` call (an empty batch is fine) so that every rank calls it once.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Split", "gather_object", "split_between_processes", "split_counts"]


@dataclass(frozen=True)
class Split:
    """How a list of ``total`` items was dealt: ``counts[r]`` real items to data-parallel rank r, each rank
    padded to ``padded`` items (equal to its count without padding)."""

    total: int
    counts: tuple[int, ...]
    padded: tuple[int, ...]

    def start(self, dp_rank: int) -> int:
        return sum(self.counts[:dp_rank])


_active: contextvars.ContextVar[Split | None] = contextvars.ContextVar("shardkit_split", default=None)


def split_counts(total: int, parts: int) -> tuple[int, ...]:
    """Contiguous, as even as possible: the first ``total % parts`` parts get one more item."""
    if parts < 1:
        raise ValueError(f"cannot split {total} items over {parts} ranks")
    base, extra = divmod(total, parts)
    return tuple(base + (1 if r < extra else 0) for r in range(parts))


def _dp_facts(dp_rank: int | None, dp_size: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if dp_rank is None:
        dp_rank = dist.get_rank() if initialized else 0
    if dp_size is None:
        dp_size = dist.get_world_size() if initialized else 1
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is not in [0, {dp_size})")
    return dp_rank, dp_size


def _is_table(items: Any) -> bool:
    """A ``datasets.Dataset`` (rows picked with ``select``), which Accelerate's split takes too."""
    return callable(getattr(items, "select", None)) and hasattr(items, "__len__") and hasattr(items, "column_names")


def _take(items: Any, start: int, stop: int) -> Any:
    if isinstance(items, dict):  # Accelerate's convention: split every value the same way
        return {k: _take(v, start, stop) for k, v in items.items()}
    return items.select(range(start, stop)) if _is_table(items) else items[start:stop]


def _pad(part: Any, to: int) -> Any:
    if isinstance(part, dict):
        return {k: _pad(v, to) for k, v in part.items()}
    missing = to - len(part)
    if missing <= 0 or len(part) == 0:
        return part
    if isinstance(part, torch.Tensor):
        return torch.cat([part, part[-1:].expand(missing, *part.shape[1:])])
    if _is_table(part):
        return part.select([*range(len(part)), *[len(part) - 1] * missing])
    return part + type(part)([part[-1]] * missing) if isinstance(part, (list, tuple)) else part


def _length(items: Any) -> int:
    if isinstance(items, dict):
        lengths = {len(v) for v in items.values()}
        if len(lengths) > 1:
            raise ValueError(f"split_between_processes: the dict's values have different lengths {sorted(lengths)}; "
                             "every value must hold one entry per item")
        return lengths.pop() if lengths else 0
    if (not isinstance(items, (Sequence, torch.Tensor)) or isinstance(items, (str, bytes))) and not _is_table(items):
        raise TypeError(f"split_between_processes takes a list, tuple, tensor, datasets.Dataset or dict of them, not "
                        f"{type(items).__name__}")
    return len(items)


@contextlib.contextmanager
def split_between_processes(items: Any, apply_padding: bool = False, *, dp_rank: int | None = None,
                            dp_size: int | None = None) -> Iterator[Any]:
    """Yield this data-parallel rank's contiguous share of ``items`` (a list, tuple, tensor, ``datasets.Dataset``,
    or dict of them).

    Args:
        apply_padding: give every rank the same number of items by repeating its last one (a rank with none
            repeats the list's last item), so every rank makes as many calls; :func:`gather_object` inside the
            block drops the repeats.
        dp_rank, dp_size: this rank's data-parallel index and the number of such ranks (default: the
            process group's rank and size; the Runner passes its strategy's, so TP peers share a share).
    """
    dp_rank, dp_size = _dp_facts(dp_rank, dp_size)
    total = _length(items)
    counts = split_counts(total, dp_size)
    longest = max(counts)
    padded = tuple(longest if apply_padding else c for c in counts)
    split = Split(total, counts, padded)
    start = split.start(dp_rank)
    part = _take(items, start, start + counts[dp_rank])
    if apply_padding and total and not counts[dp_rank]:
        part = _take(items, total - 1, total)  # fewer items than ranks: repeat the last one here too
    if apply_padding:
        part = _pad(part, longest)
    token = _active.set(split)
    try:
        yield part
    finally:
        _active.reset(token)


def gather_object(obj: Any, *, dp_rank: int | None = None, dp_size: int | None = None) -> list[Any]:
    """Every data-parallel rank's ``obj``, on every rank, in rank order (one copy per tensor-parallel group).

    A list (or tuple) is concatenated; anything else becomes one entry per data-parallel rank. Inside
    :func:`split_between_processes` the padding repeats are dropped, so the result lines up with the items
    that were split.
    """
    dp_rank, dp_size = _dp_facts(dp_rank, dp_size)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dp_rank, obj))
    else:
        everyone = [(dp_rank, obj)]
    per_dp: dict[int, Any] = {}
    for r, value in everyone:
        per_dp.setdefault(r, value)  # the first rank of each tensor-parallel group speaks for it
    if sorted(per_dp) != list(range(dp_size)):
        raise RuntimeError(f"gather_object heard from data-parallel ranks {sorted(per_dp)}, expected 0..{dp_size - 1}")
    split = _active.get()
    out: list[Any] = []
    for r in range(dp_size):
        value = per_dp[r]
        if not isinstance(value, (list, tuple)):
            out.append(value)
            continue
        if split is not None and len(split.counts) == dp_size and len(value) == split.padded[r]:
            value = value[: split.counts[r]]
        out.extend(value)
    return out
