"""Variable-length (packed) causal attention: several sequences in one row attend within themselves only.

A padding-free batch concatenates sequences and restarts ``position_ids`` at each one. :class:`Segments`
finds the sequences from the position ids (a new sequence starts wherever a position is not the previous
one plus one, and at each row's start, the rule Hugging Face's ``find_packed_sequence_indices`` uses) and
:func:`varlen_attention` runs causal attention over each of them, never across a boundary:

- on CUDA in fp16/bf16, FlashAttention's ``flash_attn_varlen_func`` when the flash-attn package is installed,
  else torch's own ``torch.nn.attention.varlen.varlen_attn`` (a FlashAttention kernel in torch >= 2.9);
- anywhere else, SDPA per sequence: ``scaled_dot_product_attention(is_causal=True)`` on a view of each long
  sequence, and short ones zero-padded into one (n, H, P, D) batch per bucket of similar lengths (within a
  sequence the padding sits after every real query, so the causal mask hides it; four buckets per octave pad by
  at most 25%). The work is near sum(L_i^2), against T^2 for a block-diagonal mask over the whole row (a
  2048-token row of 20 sequences: ~20x less arithmetic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Segments", "varlen_attention"]


@dataclass(frozen=True)
class Segments:
    """Where the sequences of a packed (B, T) batch start: ``cu_seqlens`` over the flattened B*T tokens.

    Attributes:
        cu_seqlens: int32 (n + 1,) cumulative lengths, on the batch's device (what varlen kernels take).
        lengths: the n lengths, on the host (bucketing and kernel launch arguments).
        max_length: the longest sequence.
    """

    cu_seqlens: Tensor
    lengths: tuple[int, ...]
    max_length: int

    @staticmethod
    def from_position_ids(position_ids: Tensor, batch: int | None = None) -> Segments | None:
        """The sequences of a packed batch, or None when each row holds exactly one (plain causal attention).

        Args:
            position_ids: (B, T) or (1, T)/(T,) broadcast over ``batch`` rows.
            batch: number of rows (default: ``position_ids``' first dim).
        """
        pos = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
        if batch is not None and pos.shape[0] != batch:
            pos = pos.expand(batch, -1)
        rows, width = pos.shape
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        flat = starts.reshape(-1).nonzero().reshape(-1).cpu()  # NOTE: one host sync per forward, not per layer
        if flat.numel() == rows and bool((pos[:, 0] == 0).all()):
            return None
        bounds = flat.tolist() + [rows * width]
        lengths = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        cu = torch.tensor(bounds, dtype=torch.int32, device=position_ids.device)
        return Segments(cu, lengths, max(lengths))

    @staticmethod
    def from_lengths(lengths: list[int] | tuple[int, ...], device: torch.device | str = "cpu") -> Segments:
        """Segments of sequences of these lengths laid end to end."""
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + int(n))
        return Segments(torch.tensor(bounds, dtype=torch.int32, device=device), tuple(int(n) for n in lengths),
                        max(lengths) if lengths else 0)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, segments: Segments, dropout_p: float = 0.0,
                     scale: float | None = None) -> Tensor:
    """Causal attention of packed tokens, each attending only within its own sequence.

    Args:
        q: (total, Hq, D) queries of the flattened tokens.
        k, v: (total, Hkv, D); ``Hq`` a multiple of ``Hkv`` (grouped-query attention).
        segments: the sequences' boundaries over ``total`` tokens.
        dropout_p: attention dropout (training).
        scale: softmax scale (default 1/sqrt(D)).

    Returns:
        (total, Hq, D).
    """
    if q.shape[0] != sum(segments.lengths):
        raise ValueError(f"varlen_attention: {q.shape[0]} tokens but the segments cover {sum(segments.lengths)}")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = _flash_varlen(q, k, v, segments, dropout_p, scale)
        if out is not None:
            return out
    return _bucketed_sdpa(q, k, v, segments, dropout_p, scale)


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, seg: Segments, dropout_p: float, scale: float | None):
    cu = seg.cu_seqlens.to(device=q.device, dtype=torch.int32)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if flash_attn_varlen_func is not None:
        return flash_attn_varlen_func(q, k, v, cu, cu, seg.max_length, seg.max_length, dropout_p=dropout_p,
                                      softmax_scale=scale, causal=True)
    if dropout_p:
        return None  # torch's varlen kernel has no dropout: the bucketed path does
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn(q, k, v, cu, cu, seg.max_length, seg.max_length, scale=scale, window_size=(-1, 0),
                       enable_gqa=k.shape[1] != q.shape[1])


def _bucket(length: int) -> int:
    """Padded length of a sequence's bucket: four buckets per octave (at most 25% padding), 16 at least."""
    if length <= 16:
        return 16
    step = 1 << max(math.floor(math.log2(length)) - 2, 0)
    return -(-length // step) * step


# Sequences this long run as one SDPA call each, on views of the packed tensors (no copy): measured on CPU (4 rows
# of 512 tokens, H=4, D=64, 9 to 23 sequences) 1.4-1.75x faster than padding them into buckets, whose pads,
# stacks and their backward cost more than the attention. Shorter ones are batched per bucket: 100 sequences of
# 20 tokens take 98 ms batched against 134 ms one call each (per-call overhead).
_ALONE = 128


def _bucketed_sdpa(q: Tensor, k: Tensor, v: Tensor, seg: Segments, dropout_p: float, scale: float | None) -> Tensor:
    parts = [torch.split(t, list(seg.lengths)) for t in (q, k, v)]  # views; the backward is one concatenation
    outputs: list[Tensor | None] = [None] * len(seg.lengths)
    gqa = k.shape[1] != q.shape[1]

    def attend(qb: Tensor, kb: Tensor, vb: Tensor) -> Tensor:  # (m, width, H, D) -> (m, width, H, D)
        out = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                             dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)

    groups: dict[int, list[int]] = {}
    for i, n in enumerate(seg.lengths):
        if n >= _ALONE:
            outputs[i] = attend(*(part[i][None] for part in parts))[0]
        else:
            groups.setdefault(min(_bucket(n), seg.max_length), []).append(i)
    for width, members in groups.items():
        # Zero padding after a sequence's end: the causal mask hides it from every real query, and the padded
        # queries' outputs are dropped.
        out = attend(*(torch.stack([F.pad(part[i], (0, 0, 0, 0, 0, width - seg.lengths[i])) for i in members])
                       for part in parts))
        for row, i in enumerate(members):
            outputs[i] = out[row, : seg.lengths[i]]
    return torch.cat(outputs)
