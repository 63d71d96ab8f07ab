"""The plain-PyTorch SwiGLU feed-forward shardkit's models share (the Llama's dense MLP, an MoE's shared experts);
``shardkit.nn.SwiGLUMLP`` is the fused one with the same parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainSwiGLUMLP"]


class PlainSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases (Hugging Face's Llama MLP parameter names)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
