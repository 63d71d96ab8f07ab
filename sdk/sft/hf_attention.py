"""Packed-sequence attention for Hugging Face models: ``attn_implementation="shardkit_varlen"``.

Hugging Face's ``sdpa`` keeps packed sequences apart too (it builds a block-diagonal mask from ``position_ids``
when no attention mask is given), but that mask is (T x T) per row and the attention runs over all of it. This
implementation runs :func:`shardkit.nn.varlen.varlen_attention` instead: FlashAttention's varlen kernel on a GPU,
bucketed SDPA elsewhere, with work near sum(L_i^2). Batches it does not handle (a padding mask, a KV cache) go to
``sdpa`` unchanged, so it is a drop-in for training and generation alike.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from shardkit.nn.varlen import Segments, varlen_attention

__all__ = ["VARLEN_ATTENTION", "register_varlen_attention", "use_varlen_attention"]

VARLEN_ATTENTION = "shardkit_varlen"

# The decoder layers of one forward share one position_ids tensor: its segments are found once, not per layer.
_last: tuple[Any, Segments | None] = (None, None)


def _segments(position_ids: torch.Tensor, batch: int, cu_seq_lens: torch.Tensor | None) -> Segments | None:
    global _last
    ref, cached = _last
    key = cu_seq_lens if cu_seq_lens is not None else position_ids
    if ref is not None and ref() is key:
        return cached
    if cu_seq_lens is not None:
        bounds = cu_seq_lens.tolist()
        segments = Segments.from_lengths([b - a for a, b in zip(bounds[:-1], bounds[1:])], cu_seq_lens.device)
    else:
        segments = Segments.from_position_ids(position_ids, batch)
    _last = (weakref.ref(key), segments)
    return segments


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, _, length, head_dim = query.shape
    position_ids = kwargs.get("position_ids")
    packed = attention_mask is None and key.shape[2] == length and (
        position_ids is not None or kwargs.get("cu_seq_lens_q") is not None)
    segments = _segments(position_ids, batch, kwargs.get("cu_seq_lens_q")) if packed else None
    if segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    flat = [t.transpose(1, 2).reshape(batch * length, -1, head_dim) for t in (query, key, value)]
    out = varlen_attention(*flat, segments, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, length, -1, head_dim), None


def _mask(*args: Any, **kwargs: Any):
    from transformers.masking_utils import sdpa_mask

    # No padding mask and no cache: the attention reads the sequences from position_ids (no T x T mask is built).
    if kwargs.get("attention_mask") is None and kwargs.get("q_offset", 0) == 0 and kwargs.get("kv_offset", 0) == 0 \
            and kwargs.get("q_length") == kwargs.get("kv_length"):
        return None
    return sdpa_mask(*args, **kwargs)


def register_varlen_attention() -> str:
    """Register ``"shardkit_varlen"`` with transformers' attention and mask interfaces (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, _attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _mask)
    return VARLEN_ATTENTION


def use_varlen_attention(model: torch.nn.Module) -> bool:
    """Switch a Hugging Face model running ``sdpa`` or ``eager`` attention to ``"shardkit_varlen"``.

    Returns True when switched; FlashAttention and other implementations are kept (they handle packed batches
    themselves), as are models that are not Hugging Face ones.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if getattr(config, "output_attentions", False):
        return False  # eager attention weights were asked for
    register_varlen_attention()
    model.set_attn_implementation(VARLEN_ATTENTION)
    return True
