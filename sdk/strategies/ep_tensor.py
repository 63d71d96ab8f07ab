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

Tensor parallelism inside the experts (``expert_tp=True``, torchtitan's etp = tp; :class:`ExpertTensorDispatch`):
``ep`` is borrowed from ``dp_shard`` only, so an ep group is the data-parallel ranks of one tp coordinate and the tp
peers hold the same experts. Each tp rank r computes its block of every local expert: rows ``[r I/tp, (r+1) I/tp)``
of gate AND of up (the stacked ``gate_up_proj`` packs gate then up, so the block is two strided row ranges, stacked
so that the SwiGLU's ``chunk(2)`` pairs them as on one device) and the same columns of ``down_proj``, whose partial
outputs are summed over tp. The tp peers share the dispatch: tp rank r sends only its ``1 / tp`` share of the
expert-sorted assignments over ep (each assignment crosses the all-to-all once), the receiving peers all-gather what
they received (each runs its block on all of its ep group's assignments: ``1 / tp`` of each expert's work), and the
partial outputs are summed and scattered back to the peer whose share they are (a reduce-scatter) before the return
all-to-all. An expert's gradient is its ep group's batches' sum, scaled by ``1 / ep``. Each tp peer holds only its
block (a DTensor ``Shard(0)`` over ep and its block's placement over tp, :mod:`~shardkit.strategies.ep_expert_tp`),
so the expert weights, their gradients and their AdamW state are split over tp like the compute; the global shapes
are the model's, so checkpoints are the one layout. With ``ep < dp`` only ``expert_sharding="none"`` is built (FSDP2
over the replicas is refused by name).

With context parallelism too (``cp_size > 1``, EP x CP x TP): the same dispatchers on each rank's chunk of the
sequences, with ep borrowing the cp ranks as well and the statistics summed over the cp ranks too
(:mod:`~shardkit.strategies.ep_cp_tensor`).

Hugging Face MoE models (transformers 5's Qwen3-MoE, Mixtral): the dense layers are split by transformers' own plan
without its expert entries (:mod:`shardkit.strategies.ep_hf_tensor`), the expert blocks dispatched as above, the
router whole on every tp rank; with ``expert_tp`` each tp peer runs its block of the block's experts, as for
shardkit's MoE layer; with ``sequence_parallel`` by the plan's sequence-parallel form
(:mod:`~shardkit.strategies.ep_hf_tensor`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit.strategies.ep_exchange import exchange
from shardkit.strategies.ep_hf_tensor import hf_dense_plan
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.tensor_parallel import resolve_plan, validate_heads

__all__ = ["ExpertTensorDispatch", "TensorSplitDispatch", "apply_tensor_parallel", "check_expert_tp",
           "check_tensor_options", "stats_group"]


def check_tensor_options(tp_size: Any, sequence_parallel: Any, expert_tp: Any) -> None:
    """Named errors for ExpertParallel's tensor-parallel arguments (before any process group exists)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"ExpertParallel tp_size={tp_size!r} must be an int >= 1 (1: no tensor parallelism)")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"ExpertParallel sequence_parallel={sequence_parallel!r} must be True or False")
    if sequence_parallel and tp_size == 1:
        raise ValueError("ExpertParallel sequence_parallel=True splits the tensor-parallel plan's norms and residual "
                         "stream over tp: it needs tp_size > 1")
    if not isinstance(expert_tp, bool):
        raise ValueError(f"ExpertParallel expert_tp={expert_tp!r} must be True or False")
    if expert_tp and tp_size == 1:
        raise ValueError("ExpertParallel expert_tp=True splits each expert's matrices over the tp ranks: it needs "
                         "tp_size > 1")


def apply_tensor_parallel(module: nn.Module, tp_mesh: Any, dims: ParallelDims, sequence_parallel: bool,
                          hf_blocks: list[nn.Module]) -> None:
    """Split the dense layers over ``tp_mesh`` by the model's own plan (its routed experts are in no plan: they are
    split over ep afterwards).

    A Hugging Face MoE model is split by transformers' own plan without its expert blocks' entries
    (:func:`~shardkit.strategies.ep_hf_tensor.hf_dense_plan`); its router stays whole on every tp rank.

    Raises:
        ValueError: a Hugging Face model whose layout the sequence-parallel form does not map, or head counts tp
            does not divide, or a model without a plan (as :class:`~shardkit.strategies.TensorParallel`).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    validate_heads(module, dims)
    # src_data_rank=None: each rank cuts its part from its own copy, which is already equal on every rank (rank 0's
    # broadcast, or the recorded init replayed later); a scatter from rank 0 would wait on meta ranks.
    # A Hugging Face MoE model: transformers' plan without its expert blocks (split over ep, not tp).
    plan = hf_dense_plan(module, hf_blocks, dims.tp, sequence_parallel) if hf_blocks else \
        resolve_plan(module, None, dims.tp, sequence_parallel)
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


class _InnerStatistics:
    """The routing statistics and the context-parallel switch of a tp dispatcher are its ep dispatcher's
    (``inner``): the tp peers route the same tokens, so they add nothing to the sums."""

    inner: Any

    def global_sum(self, local: torch.Tensor) -> torch.Tensor:
        return self.inner.global_sum(local)

    def global_counts(self, local: torch.Tensor) -> torch.Tensor:
        return self.inner.global_counts(local)

    @property
    def enabled(self) -> bool:
        """``inner``'s: the context-parallel forward turns it off around its unsplit forward."""
        return self.inner.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.inner.enabled = on


class TensorSplitDispatch(_InnerStatistics):
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


# ---- tensor parallelism inside the experts (expert_tp=True) ------------------------------------------------------


def check_expert_tp(dims: ParallelDims, intermediate_size: int, expert_sharding: str) -> None:
    """Named errors for ``expert_tp=True`` once the sizes are known.

    Raises:
        ValueError: tp does not divide the experts' intermediate size, or ``expert_sharding="full"`` with replicas
            of the experts (FSDP2 over a weight already split over ep x tp is not built).
    """
    if intermediate_size % dims.tp:
        raise ValueError(f"ExpertParallel expert_tp=True: the experts' intermediate size ({intermediate_size}) % "
                         f"tp({dims.tp}) != 0: each tp rank takes an equal column block of gate and of up; pick a tp "
                         "that divides it, or expert_tp=False")
    if dims.expert_replicas > 1 and expert_sharding == "full":
        raise ValueError(f"ExpertParallel expert_tp=True with {dims.expert_replicas} ranks holding the same experts "
                         "(ep < dp): expert_sharding='full' (FSDP2 over them) is not built with tensor parallelism "
                         "inside the experts; use expert_sharding='none' (gradients all-reduced over them) or "
                         "ep_size equal to the data-parallel size")


def _scatter_sum(x: torch.Tensor, bounds: list[int], rank: int, group: Any) -> torch.Tensor:
    """Rows ``[bounds[rank], bounds[rank+1])`` of ``x`` summed over the tp peers (a reduce-scatter over uneven row
    blocks, as an all-to-all: gloo has no reduce-scatter), summed in at least fp32."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    mine = sizes[rank]
    if bounds[-1] == 0:  # the same on every peer: nothing to exchange
        return x.new_zeros((0, *x.shape[1:]))
    out = x.new_empty((mine * len(sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), [mine] * len(sizes), sizes, group=group)
    acc = torch.promote_types(x.dtype, torch.float32)
    return out.reshape(len(sizes), mine, *x.shape[1:]).to(acc).sum(0).to(x.dtype)


class _GatherSum(torch.autograd.Function):
    """The tp peers' row blocks concatenated (each peer computes its own part of the experts on all of them); the
    backward sums the peers' gradients of this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bounds: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.bounds, ctx.rank, ctx.group = bounds, rank, group
        return _gather_rows(x, bounds, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _scatter_sum(grad, ctx.bounds, ctx.rank, ctx.group), None, None, None


class _ScatterSum(torch.autograd.Function):
    """This rank's rows of the peers' partial outputs, summed; the backward gathers every peer's rows' gradient (the
    gradient of each partial output is the sum's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bounds: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.bounds, ctx.group = bounds, group
        return _scatter_sum(x, bounds, rank, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _gather_rows(grad, ctx.bounds, ctx.group), None, None, None


class ExpertTensorDispatch(_InnerStatistics):
    """An MoE layer's ``dispatcher`` under ``expert_tp=True``: the experts split over ep (ranks of one tp
    coordinate, different batches) and each expert's matrices split over the tp peers (see the module docstring).

    How the tp peers, which route the same tokens, share the dispatch: tp rank r sends only the r-th contiguous
    ``1 / tp`` share of the expert-sorted assignments over its ep group (so the all-to-all carries each assignment
    once); the receiving tp peers all-gather what they received, so each runs its column block of every local
    expert on all of the ep group's assignments (the split the layout requires: ``1 / tp`` of each expert's work
    per peer); the partial down-projection outputs are summed over tp and scattered back to the rank whose share
    they are (a reduce-scatter), which returns them over ep; the tp peers then all-gather the shares' outputs.

    Args:
        inner: the ep dispatcher whose statistics (:func:`stats_group`) and weight view (its ``grad_scale``
            ``1 / ep``) this one uses.
        ep_group, tp_group: the ep group (this tp coordinate's data-parallel ranks holding the experts between
            them) and the tp peers (same tokens, same experts).
    """

    def __init__(self, inner: Any, ep_group: Any, tp_group: Any):
        self.inner, self.ep_group, self.tp_group = inner, ep_group, tp_group
        self.ep_size = dist.get_world_size(ep_group)
        self.tp_size, self.tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)

    def weight_view(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's block of its experts' stacked weight: the local shard it holds
        (:mod:`~shardkit.strategies.ep_expert_tp`), its gradient scaled as ``inner``'s (``1 / ep``: the ep group's
        batches are summed into it, the replicas of the experts average it)."""
        return self.inner.weight_view(weight)

    def run(self, experts: nn.Module, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs for ``tokens`` (sorted by global expert, ``counts`` per expert), whole on every tp rank."""
        total, n = tokens.shape[0], self.tp_size
        bounds = [r * total // n for r in range(n + 1)]
        mine = _TakeShare.apply(tokens, bounds, self.tp_rank, self.tp_group)
        ranks = self.ep_size
        per_rank = counts.numel() // ranks
        send = _share(counts, bounds[self.tp_rank], bounds[self.tp_rank + 1]).reshape(ranks, per_rank).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)  # recv[s, j]: source s, local expert j
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = exchange(mine, out_splits, in_splits, self.ep_group)  # grouped by source, then expert
        peers = [torch.empty_like(recv) for _ in range(n)]
        dist.all_gather(peers, recv, group=self.tp_group)
        sizes = [int(p.sum()) for p in peers]
        rows = [sum(sizes[:r]) for r in range(n + 1)]
        every = _GatherSum.apply(received, rows, self.tp_rank, self.tp_group)
        local = torch.arange(ranks * per_rank, device=tokens.device) % per_rank
        expert = torch.cat([torch.repeat_interleave(local, p.reshape(-1)) for p in peers])
        by_expert = torch.sort(expert, stable=True).indices
        partial = experts(every[by_expert], torch.stack(peers).sum((0, 1)))
        out = _ScatterSum.apply(partial[torch.argsort(by_expert)], rows, self.tp_rank, self.tp_group)
        back = exchange(out, in_splits, out_splits, self.ep_group)
        return _GatherShares.apply(back, bounds, self.tp_rank, self.tp_group)
