"""Padded rows for shardkit's Llama: the ``attention_mask`` check and the attention mask that keeps padding out."""

from __future__ import annotations

import torch

__all__ = ["check_attention_mask", "padded_causal_mask"]


def check_attention_mask(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``attention_mask`` as a (B, T) bool tensor of input_ids' shape (1/True: a real token), or a ValueError."""
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"Llama: attention_mask of shape {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}")
    if attention_mask.dtype != torch.bool:
        if attention_mask.is_floating_point() or attention_mask.is_complex():
            raise ValueError(f"Llama: attention_mask must hold 0/1 integers or booleans, got {attention_mask.dtype}")
        if attention_mask.numel() and attention_mask.device.type == "cpu" and \
                not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("Llama: attention_mask holds values other than 0 and 1 (1: a real token, 0: padding)")
        attention_mask = attention_mask != 0
    return attention_mask


def padded_causal_mask(key_mask: torch.Tensor, past: int, seq: int) -> torch.Tensor:
    """(B, 1, T, past + T) bool: query i (at position past + i) sees the real keys up to itself. A padding query
    also sees itself, so that its row of the softmax is never empty (its output is finite and unused)."""
    keys = torch.arange(past + seq, device=key_mask.device)
    queries = torch.arange(past, past + seq, device=key_mask.device)[:, None]
    allowed = (keys <= queries) & key_mask[:, None, None, :]
    return allowed | (keys == queries)
