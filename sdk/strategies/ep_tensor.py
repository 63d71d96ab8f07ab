"""Expert parallelism composed with tensor parallelism (EP x TP): what :class:`~shardkit.strategies.ExpertParallel`
adds when ``tp_size > 1``.

The layout is torchtitan's default (expert tensor parallel degree 1, "etp=1"): the dense layers are split over
``tp`` by the model's tensor-parallel plan (shardkit's Llama: :func:`~shardkit.models.llama_tp.llama_plan`, with or
without sequence parallelism), FSDP2 shards them over the data-parallel ranks, and ``ep`` is borrowed from
``dp_shard x tp`` (it must be a multiple of tp dividing ``dp_shard * tp``): the tp peers, which see the same batch,
hold different experts. Each expert stays whole on its rank (no tensor parallelism inside the experts).

An MoE layer under tp sees its tokens whole on every tp rank (llama_plan gathers the sequence-parallel shards before
it). The router runs on all of them on every tp rank, so the routing weights, the load and the auxiliary loss are
the same on the tp peers and counted once (the statistics are summed over the data-parallel ranks of one tp
coordinate only). The expert work is not repeated: of the assignments sorted by expert, tp rank r takes the r-th
contiguous ``1 / tp`` share (:class:`TensorSplitDispatch`), sends it to the experts' ranks over ep (all-to-all) and
gets its outputs back; the tp peers then all-gather the outputs, so every tp rank weights and sums them per token
as on one device. In the backward the gather hands each rank its share's gradient and the share all-gathers the
input gradient, so the residual stream's gradient is whole and equal on the tp peers, as tensor parallelism wants.

Gradients: an expert's weights see the assignments of every rank of its ep group, which are ``ep / tp`` batches
split over their tp peers, so the sum over the group is the gradient of those ``ep / tp`` batches' losses; the local
weights are scaled by ``tp / ep`` (their mean) and FSDP2 averages over the ``dp * tp / ep`` ranks holding the same
experts (``ParallelDims.expert_replicas``), which leaves the mean over every batch: one device's gradient.

Not built here: tensor parallelism inside the experts (torchtitan's etp = tp), ep x tp with context parallelism,
and Hugging Face expert blocks under tp (transformers' own plan splits their experts); each is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.tensor_parallel import resolve_plan, validate_heads

__all__ = ["TensorSplitDispatch", "apply_tensor_parallel", "check_tensor_options", "stats_group"]


def check_tensor_options(tp_size: Any, sequence_parallel: Any, cp_size: int, expert_tp: Any) -> None:
    """Named errors for ExpertParallel's tensor-parallel arguments (before any process group exists)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"ExpertParallel tp_size={tp_size!r} must be an int >= 1 (1: no tensor parallelism)")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"ExpertParallel sequence_parallel={sequence_parallel!r} must be True or False")
    if sequence_parallel and tp_size == 1:
        raise ValueError("ExpertParallel sequence_parallel=True splits the tensor-parallel plan's norms and residual "
                         "stream over tp: it needs tp_size > 1")
    if tp_size > 1 and cp_size > 1:
        raise ValueError(f"ExpertParallel tp_size={tp_size} with cp_size={cp_size}: expert parallelism with both "
                         "tensor and context parallelism is not built; use tp_size or cp_size, or "
                         "ContextParallel(cp_size=..., tp_size=...) with the experts whole on every rank")
    if expert_tp not in (False, None):
        raise ValueError(f"ExpertParallel expert_tp={expert_tp!r}: tensor parallelism inside the experts (each "
                         "expert's gate_up/down split over tp, torchtitan's etp = tp) is not built; the experts stay "
                         "whole on their ep rank and tp ranks split the tokens instead (expert_tp=False, the default)")


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, dims: ParallelDims, sequence_parallel: bool,
                          hf_blocks: list[nn.Module]) -> None:
    """Split the dense layers over ``tp_mesh`` by the model's own plan (its routed experts are in no plan: they are
    split over ep afterwards).

    Raises:
        ValueError: a Hugging Face expert block (transformers' plan would split it over tp), or head counts tp does
            not divide, or a model without a plan (as :class:`~shardkit.strategies.TensorParallel`).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if hf_blocks:
        raise ValueError(f"ExpertParallel tp_size={dims.tp}: {type(module).__name__} holds Hugging Face expert blocks "
                         f"({type(hf_blocks[0]).__name__}), whose own tensor-parallel plan splits the experts over tp "
                         "(not built with expert parallelism here); use tp_size=1 (ep over the data-parallel ranks) "
                         "or shardkit's MoE Llama")
    validate_heads(module, dims)
    # src_data_rank=None: each rank cuts its part from its own copy, which is already equal on every rank (rank 0's
    # broadcast, or the recorded init replayed later); a scatter from rank 0 would wait on meta ranks.
    plan = resolve_plan(module, None, dims.tp, sequence_parallel)
    parallelize_module(module, tp_mesh, plan, src_data_rank=None)


def stats_group(world_mesh: Any, dims: ParallelDims) -> Any:
    """The ranks routing statistics are summed over under tp: the data-parallel ranks of this tp coordinate (the tp
    peers route the same tokens, so a sum over them would count each token tp times)."""
    names = ("shard",) if dims.dp_replicate == 1 else ("replicate", "shard")
    return ParallelDims.submesh(world_mesh, names).get_group()


class _TakeShare(torch.autograd.Function):
    """Rows ``[lo, hi)`` of a tensor equal on the tp peers; the backward gathers every peer's rows' gradient, so the
    input's gradient is whole (and the same) on each of them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bounds: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.bounds, ctx.group, ctx.rows = bounds, group, x.shape[0]
        return x[bounds[rank]:bounds[rank + 1]]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather_rows(grad, ctx.bounds, ctx.group), None, None, None


class _GatherShares(torch.autograd.Function):
    """Every tp peer's rows, concatenated in rank order; the backward keeps this rank's rows of the gradient (the
    gradient is the same on the tp peers, whose computations after the gather are the same)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bounds: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.lo, ctx.hi = bounds[rank], bounds[rank + 1]
        return _gather_rows(x, bounds, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad[ctx.lo:ctx.hi].contiguous(), None, None, None


def _gather_rows(x: torch.Tensor, bounds: list[int], group: Any) -> torch.Tensor:
    """The peers' row blocks (sizes from ``bounds``) in rank order; padded to one size, as gloo's all_gather wants."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    width = max(sizes)
    if width == 0:  # no assignment on any peer (every token padding): the same on all of them, nothing to send
        return x.new_zeros((0, *x.shape[1:]))
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _share(counts: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Per expert, how many of the expert-sorted assignments ``[lo, hi)`` it holds."""
    ends = counts.cumsum(0)
    return ends.clamp(lo, hi) - (ends - counts).clamp(lo, hi)


class TensorSplitDispatch:
    """An MoE layer's ``dispatcher`` under EP x TP: this tp rank's share of the assignments goes through ``inner``
    (the ep all-to-all, :class:`~shardkit.strategies.expert_parallel.AllToAllDispatch`), the outputs are gathered over
    tp; the statistics are ``inner``'s.

    Args:
        inner: the ep dispatcher, its ``grad_scale`` ``tp / ep`` (see the module docstring) and its statistics
            group :func:`stats_group`.
        tp_group: the tp peers (same tokens, same routing).
    """

    def __init__(self, inner: Any, tp_group: Any):
        self.inner, self.tp_group = inner, tp_group
        self.tp_size, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def weight_view(self, weight: torch.Tensor) -> torch.Tensor:
        return self.inner.weight_view(weight)

    def run(self, experts: nn.Module, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs for ``tokens`` (sorted by global expert, ``counts`` per expert), whole on every tp rank; this
        rank's experts compute only the assignments the tp ranks sharing its batch send them."""
        total, n = tokens.shape[0], self.tp_size
        bounds = [r * total // n for r in range(n + 1)]
        mine = _TakeShare.apply(tokens, bounds, self.tp_rank, self.tp_group)
        out = self.inner.run(experts, mine, _share(counts, bounds[self.tp_rank], bounds[self.tp_rank + 1]))
        return _GatherShares.apply(out, bounds, self.tp_rank, self.tp_group)

    def global_sum(self, local: torch.Tensor) -> torch.Tensor:
        return self.inner.global_sum(local)

    def global_counts(self, local: torch.Tensor) -> torch.Tensor:
        return self.inner.global_counts(local)
