"""The all-to-all that expert parallelism sends tokens to their experts with, differentiable: its backward is the same
exchange with the splits swapped (what rank r sent to rank s comes back from s to r)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["exchange"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """``all_to_all_single`` of ``x``'s rows over ``group``: ``in_splits[s]`` rows go to rank s, ``out_splits[s]``
    rows come from it (in rank order)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)
