"""Assembling a region (a box or a flat range) of a sharded tensor from its pieces.

Every piece is seen as one or more boxes of the global tensor: a box piece is itself, a flat-range
piece splits into at most ``2 * ndim - 1`` boxes (:func:`flat_to_boxes`), each contiguous in the
piece's 1-D data. A flat-range request splits the same way. So all cases reduce to box against box,
and only the rows a request needs are read from disk (lazy safetensors slices).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .format import CheckpointError, dtype_from_tag, flat_to_boxes

__all__ = ["read_region"]

Getter = Callable[[str, str, "tuple | None"], torch.Tensor]


def read_region(get: Getter, entry: dict[str, Any], where: str, *, box: tuple | None = None,
                flat: tuple[int, int] | None = None) -> torch.Tensor:
    """Reads a box ``(offsets, shape)`` or a flat range ``(start, end)`` of one sharded tensor.

    Args:
        get: ``get(file, tensor_name, slices_or_None)`` returning a CPU tensor.
        entry: the tensor's index entry: ``{"shape", "dtype", "pieces": [...]}``.
        where: names the tensor in error messages.
    """
    gshape = tuple(entry["shape"])
    dtype = dtype_from_tag(entry["dtype"], where)
    if flat is not None:
        start, end = flat
        if not 0 <= start <= end <= math.prod(gshape):
            raise CheckpointError(f"{where}: flat range [{start}, {end}) is outside 0..{math.prod(gshape)}")
        out = torch.empty(end - start, dtype=dtype)
        mask = torch.zeros(end - start, dtype=torch.bool)
        for off, shape, fstart in flat_to_boxes(start, end, gshape):
            n = math.prod(shape)
            sub = slice(fstart - start, fstart - start + n)
            _fill(get, entry, gshape, out[sub].view(shape), mask[sub].view(shape), off, shape, where)
        first = None if bool(mask.all()) else (int((~mask).nonzero()[0, 0]) + start,)
    else:
        off, shape = tuple(box[0]), tuple(box[1])
        if len(off) != len(gshape) or len(shape) != len(gshape) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(off, shape, gshape)):
            raise CheckpointError(f"{where}: box at {off} with shape {shape} is outside global shape {gshape}")
        out = torch.empty(shape, dtype=dtype)
        mask = torch.zeros(shape, dtype=torch.bool)
        _fill(get, entry, gshape, out, mask, off, shape, where)
        first = None if bool(mask.all()) else tuple(int(i) + o for i, o in zip((~mask).nonzero()[0], off))
    if first is not None:
        raise CheckpointError(f"{where}: the saved pieces do not cover the requested region; element {first} "
                              f"of global shape {gshape} is in no piece (a rank's shard file is missing from "
                              "the index?)")
    return out


def _piece_boxes(piece: dict[str, Any], gshape: tuple[int, ...]) -> list[tuple[tuple, tuple, int | None]]:
    """(offsets, shape, flat start within the piece's 1-D data or None for a box piece)."""
    if "offsets" in piece:
        return [(tuple(piece["offsets"]), tuple(piece["shape"]), None)]
    a, b = piece["flat_range"]
    return [(o, s, f - a) for o, s, f in flat_to_boxes(a, b, gshape)]


def _fill(get: Getter, entry: dict[str, Any], gshape: tuple[int, ...], out: torch.Tensor, mask: torch.Tensor,
          req_off: tuple, req_shape: tuple, where: str) -> None:
    if out.numel() == 0:
        return
    for piece in entry["pieces"]:
        for b_off, b_shape, data_start in _piece_boxes(piece, gshape):
            lo = [max(r, b) for r, b in zip(req_off, b_off)]
            hi = [min(r + rs, b + bs) for r, rs, b, bs in zip(req_off, req_shape, b_off, b_shape)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            dst = tuple(slice(lo_ - r, h - r) for lo_, h, r in zip(lo, hi, req_off))
            if bool(mask[dst].all()):
                continue  # already covered by a replica
            src = tuple(slice(lo_ - b, h - b) for lo_, h, b in zip(lo, hi, b_off))
            data = _read_piece_box(get, piece, b_shape, data_start, src)
            if data.dtype != out.dtype or tuple(data.shape) != tuple(out[dst].shape):
                raise CheckpointError(f"{where}: piece in {piece['file']} holds {data.dtype} {list(data.shape)}, "
                                      f"expected {out.dtype} {list(out[dst].shape)}: the index is corrupt")
            out[dst] = data
            mask[dst] = True


def _read_piece_box(get: Getter, piece: dict[str, Any], b_shape: tuple, data_start: int | None,
                    src: tuple[slice, ...]) -> torch.Tensor:
    if data_start is None:  # box piece: slice it directly
        return get(piece["file"], piece["tensor"], src if src else None)
    if not b_shape:  # a 0-d global tensor stored as a 1-element flat range
        return get(piece["file"], piece["tensor"], (slice(data_start, data_start + 1),)).reshape(())
    row = math.prod(b_shape[1:])
    r0, r1 = src[0].start, src[0].stop
    data = get(piece["file"], piece["tensor"], (slice(data_start + r0 * row, data_start + r1 * row),))
    return data.reshape((r1 - r0, *b_shape[1:]))[(slice(None), *src[1:])]
