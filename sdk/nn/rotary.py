"""Rotary embedding module: cos/sin tables (Hugging Face layout) and :func:`shardkit.ops.rope`."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from typing_extensions import override

from ..ops import rope

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin of shape (max_position, head_dim) with HF's duplicated halves ``cat(freqs, freqs)``.

    ``forward(position_ids)`` returns ``(cos, sin)`` of shape (B, T, head_dim) like HF's
    ``LlamaRotaryEmbedding``; :meth:`rotate` rotates q and k in one fused call, indexing the tables by
    ``position_ids`` inside the kernel instead of materialising (B, T, D) copies.

    Args:
        head_dim: per-head size (even).
        max_position: number of positions in the tables.
        base: the RoPE theta.
    """

    def __init__(self, head_dim: int, max_position: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        self.head_dim, self.max_position, self.base = head_dim, max_position, float(base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # fp32 tables, not saved in state dicts (HF does not save them either)
        self.register_buffer("cos_cached", emb.cos().float(), persistent=False)
        self.register_buffer("sin_cached", emb.sin().float(), persistent=False)

    @override
    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.cos_cached[position_ids], self.sin_cached[position_ids]

    def rotate(self, q: Tensor, k: Tensor, position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Rotate q (B, Hq, T, D) and k (B, Hk, T, D) at ``position_ids`` (B, T), (1, T) or (T,), default 0..T-1.

        Raises:
            ValueError: T > ``max_position`` without position_ids (the message names the length needed).
            IndexError: a position >= ``max_position`` (CPU tensors; on CUDA a device-side assert).
        """
        if position_ids is None:
            return rope(q, k, self.cos_cached, self.sin_cached)
        return rope(q, k, self.cos_cached, self.sin_cached, position_ids)

    @override
    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}, base={self.base}"
