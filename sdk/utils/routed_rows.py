"""Rows gathered by index and summed back by index, the two ends of an MoE layer's expert dispatch, with every sum
over assignments in at least fp32.

A token's top-k expert outputs are summed into its row, and in the backward the k gradients reaching a gathered
token are summed into its input's gradient. In bf16 or fp16 each of those sums, done in place in the activation
dtype, rounds once per assignment (CUDA's ``index_add`` adds atomically in the tensor's own dtype); the one-device
routed function (``shardkit.models.moe_experts``) sums in fp32 and rounds once. These helpers are what the dispatchers
that move tokens to other ranks (shardkit's MoE layer and expert parallelism's Hugging Face forward) use, so that
both forms of one model sum alike.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gather_rows", "sum_rows"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        total = torch.zeros((ctx.rows, *grad.shape[1:]), dtype=_wide(grad.dtype), device=grad.device)
        return total.index_add_(0, index, grad.to(total.dtype)).to(grad.dtype), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` (rows), whose gradient sums the rows' gradients per row of ``x`` in at least fp32."""
    return _GatherRows.apply(x, index) if x.dtype in _LOW_PRECISION else x[index]


def sum_rows(rows: torch.Tensor, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed as ``like`` whose row ``t`` is the sum of the ``rows`` with ``index == t``, summed in
    at least fp32 and rounded once."""
    wide = _wide(like.dtype)
    total = torch.zeros(like.shape, dtype=wide, device=like.device).index_add(0, index, rows.to(wide))
    return total.to(like.dtype)
