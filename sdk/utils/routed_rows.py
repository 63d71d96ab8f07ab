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

__all__ = ["gather_rows", "sort_assignments", "sum_rows"]

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


def sort_assignments(top_k_index: torch.Tensor, num_experts: int,
                     real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, token, counts)`` for the assignments of ``top_k_index`` (N, k): their flat indices grouped by expert
    (token order inside each), each one's token, and the assignments per expert. With ``real`` (N bools, False at
    padding) the padding's assignments are left out of all three."""
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    if real is None:
        order = torch.sort(flat, stable=True).indices
        return order, order // top_k, torch.bincount(flat, minlength=num_experts)
    # padding's assignments take an expert past the last: the stable sort puts them after every real one, cut off
    flat = flat.masked_fill(~real.repeat_interleave(top_k), num_experts)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    order = torch.sort(flat, stable=True).indices[: int(real.sum()) * top_k]
    return order, order // top_k, counts
