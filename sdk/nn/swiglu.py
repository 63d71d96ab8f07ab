"""Gated MLPs over :func:`shardkit.ops.swiglu` (Llama's) and :func:`shardkit.ops.geglu` (Gemma's)."""

from __future__ import annotations

from torch import Tensor, nn
from typing_extensions import override

from ..ops import geglu, swiglu

__all__ = ["GeGLUMLP", "SwiGLUMLP"]


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with Hugging Face Llama's parameter names.

    The gate and up activations are fresh linear outputs nothing else reads, so backward writes their
    gradients over them (``in_place_backward``): no (tokens, intermediate) buffer allocated in backward.

    Args:
        hidden: model width.
        intermediate: MLP width.
        bias: whether the three projections have a bias.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def _gated(self, x: Tensor) -> Tensor:
        return swiglu(self.gate_proj(x), self.up_proj(x), in_place_backward=True)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self._gated(x))


class GeGLUMLP(SwiGLUMLP):
    """``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``: Gemma's MLP, same parameter names and memory."""

    @override
    def _gated(self, x: Tensor) -> Tensor:
        return geglu(self.gate_proj(x), self.up_proj(x), in_place_backward=True)
