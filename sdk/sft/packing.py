"""Packing tokenized sequences into fixed-length rows.

- ``"bfd"``: best-fit decreasing. Sequences, longest first, each go into the open bin with the least room that
  still fits it (a new bin when none does). Whole sequences only: a packed row carries ``position_ids`` restarting
  at 0 for each sequence, and the models and collators here keep attention and loss inside each sequence. The
  first label of each packed sequence is -100, so no token is predicted across a boundary.
- ``"wrapped"``: concatenate everything and cut every ``max_length`` tokens (TRL's old packing). Sequences are
  split across rows and attend to whatever precedes them in the row: it crosses sequences, by design.

Bins are found with a segment tree over the room left (0..max_length): O(log max_length) per sequence, so a
100k-sequence batch packs in about a second in pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IGNORE_INDEX", "bfd_bins", "pack_bfd", "pack_examples", "pack_wrapped", "restart_labels"]

IGNORE_INDEX = -100


class _RoomTree:
    """Which room sizes (0..capacity) some open bin has, answering "the smallest room >= n" in O(log capacity)."""

    def __init__(self, capacity: int):
        self.size = 1
        while self.size < capacity + 1:
            self.size *= 2
        self.count = [0] * (2 * self.size)  # open bins whose room is in the node's range

    def add(self, room: int, delta: int) -> None:
        i = room + self.size
        while i:
            self.count[i] += delta
            i //= 2

    def smallest_at_least(self, need: int) -> int | None:
        return self._find(1, 0, self.size - 1, need)

    def _find(self, node: int, lo: int, hi: int, need: int) -> int | None:
        if hi < need or not self.count[node]:
            return None
        if lo == hi:
            return lo
        mid = (lo + hi) // 2
        left = self._find(2 * node, lo, mid, need)
        return left if left is not None else self._find(2 * node + 1, mid + 1, hi, need)


def bfd_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of ``lengths`` in each bin of ``capacity`` tokens, bins in opening order.

    Deterministic: ties go to the earlier sequence, and among bins with equal room to the one that reached it
    last. Every length must be in [1, capacity].

    Raises:
        ValueError: a length outside [1, capacity] (truncate sequences to ``max_length`` before packing).
    """
    bad = next((n for n in lengths if not 1 <= n <= capacity), None)
    if bad is not None:
        raise ValueError(f"bfd_bins: a sequence of {bad} tokens does not fit bins of {capacity}; truncate sequences "
                         f"to max_length={capacity} (and drop empty ones) before packing")
    tree = _RoomTree(capacity)
    by_room: dict[int, list[int]] = {}  # room -> bins with exactly that room (a stack)
    bins: list[list[int]] = []
    rooms: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        room = tree.smallest_at_least(n)
        if room is None:
            bins.append([])
            rooms.append(capacity)
            target = len(bins) - 1
        else:
            target = by_room[room].pop()
            tree.add(room, -1)
        bins[target].append(index)
        rooms[target] -= n
        left = rooms[target]
        if left > 0:
            by_room.setdefault(left, []).append(target)
            tree.add(left, 1)
    return bins


def restart_labels(labels: list[int]) -> list[int]:
    """``labels`` with the first one ignored: the token a packed sequence starts with is never predicted from the
    sequence before it (for a sequence on its own the first label is never used anyway)."""
    return [IGNORE_INDEX, *labels[1:]] if labels else []


def pack_bfd(examples: Sequence[dict[str, Any]], max_length: int) -> list[dict[str, list[int]]]:
    """Pack ``{"input_ids", "labels"}`` examples into rows of at most ``max_length`` tokens (see module docstring).

    Each row: ``input_ids``, ``labels`` (first label of each sequence -100) and ``position_ids`` (restarting at 0
    with each sequence). Examples with no tokens are dropped.
    """
    kept = [e for e in examples if len(e["input_ids"])]
    rows = []
    for members in bfd_bins([len(e["input_ids"]) for e in kept], max_length):
        ids, labels, positions = [], [], []
        for i in members:
            example = kept[i]
            n = len(example["input_ids"])
            ids.extend(example["input_ids"])
            labels.extend(restart_labels(list(example["labels"])))
            positions.extend(range(n))
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return rows


def pack_wrapped(examples: Sequence[dict[str, Any]], max_length: int) -> list[dict[str, list[int]]]:
    """Concatenate the examples and cut every ``max_length`` tokens; the last, shorter row is kept.

    Rows cross sequence boundaries (attention and next-token labels run from one sequence into the next).
    """
    ids = [t for e in examples for t in e["input_ids"]]
    labels = [t for e in examples for t in e["labels"]]
    rows = []
    for start in range(0, len(ids), max_length):
        chunk = ids[start:start + max_length]
        rows.append({"input_ids": chunk, "labels": labels[start:start + max_length],
                     "position_ids": list(range(len(chunk)))})
    return rows


def pack_examples(examples: Sequence[dict[str, Any]], max_length: int, strategy: str) -> list[dict[str, list[int]]]:
    """Pack with ``strategy`` ("bfd" or "wrapped")."""
    if strategy == "bfd":
        return pack_bfd(examples, max_length)
    if strategy == "wrapped":
        return pack_wrapped(examples, max_length)
    raise ValueError(f"packing strategy {strategy!r} is not 'bfd' or 'wrapped'")
