"""Expert parallelism: each MoE layer's experts split over ``ep`` ranks, tokens sent to them by all-to-all, and FSDP2
over the data-parallel ranks for the rest of the model.

The mesh is :class:`~shardkit.strategies.parallel_dims.ParallelDims` with ``ep`` borrowed from ``dp_shard``: every
rank sees its own batch (as under FSDP). In each MoE layer (a module with a ``dispatcher`` slot and ``experts``
holding stacked ``gate_up_proj``/``down_proj`` weights, as :class:`shardkit.models.moe.MoE`; or a Hugging Face expert
block of transformers 5, whose forward is replaced by one that dispatches the same way), the stacked weights
become DTensors sharded on the expert dimension over the ``ep`` group (rank r holds experts
``[r * E / ep, (r + 1) * E / ep)``), left out of the dense FSDP2 units; the layer's dispatcher then

1. sorts the routed tokens by expert (the layer does) and exchanges the per-expert counts (all-to-all),
2. sends each expert's tokens to its rank (all-to-all), where they are regrouped by local expert and run through
   the grouped GEMM,
3. sends the outputs back (all-to-all, the reverse splits), where the layer weights and sums them per token.

Why the gradients come out right: each rank's loss is its own batch's mean and FSDP2 averages the dense gradients
over the ``dp`` ranks. An expert's weights see the tokens of every rank of its ep group, so their gradient is the
*sum* of those ranks' losses' gradients; it is scaled by ``1 / ep`` in the backward (the weight view), and averaged
over the ``dp / ep`` ranks holding the same experts (``ParallelDims.expert_replicas``), which makes it the same mean
over all ``dp`` ranks. The routing statistics (the load and the auxiliary loss's mean scores) are summed over the
data-parallel ranks, so the auxiliary loss is the whole batch's, as on one device, and the router bias moves the
same way on every rank.

Sizes: ``ep`` is borrowed from ``dp_shard`` (it must divide it); ``dp_replicate`` adds replicas of the whole model
(HSDP for the dense parameters). When ``ep < dp`` each expert is held by ``dp / ep`` ranks, as ``expert_sharding``
says:

- ``"full"`` (torchtitan's layout): FSDP2 over those ranks, ``dp_shard_mod_ep`` sharded and ``dp_replicate``
  replicated (HSDP), on top of the ep split; FSDP2 averages the gradient over them.
- ``"none"``: each of them holds its ep slice whole (a DTensor replicated over ``dp_replicate x dp_shard_mod_ep``,
  sharded over ep); the gradients are all-reduced over them after the window's last backward.

With context parallelism (``cp_size > 1``, torchtitan's rule): each sequence is split over the ``cp`` ranks, whose
attention runs ring (or Ulysses) over the whole sequence as under :class:`~shardkit.strategies.ContextParallel` (the
same forward, installed by :func:`~shardkit.strategies.context_parallel.install_context_parallel`); ep is borrowed
from ``dp_shard x cp`` (every cp rank and ``ep / cp`` dp_shard ranks, :meth:`ParallelDims.build_expert`), so the
ranks holding one sequence's chunks split the experts and each sends its chunk's tokens to their experts; the dense
parameters are FSDP2 over ``dp_shard x cp`` (HSDP over ``dp_replicate``). The gradients: each rank's loss gradient is
``cp`` times its chunk's share of its sequences' loss (FSDP2's mean over ``dp_shard x cp`` takes it back out), so an
expert's gradient, summed over the ep group's ranks, is ``cp`` times the sum of its ``ep / cp`` batches' and the
``1 / ep`` scale leaves their mean, as without cp. The routing statistics are summed over every rank (dp x cp: each
holds other tokens), their gradient scaled by that number, so the auxiliary loss (added to the loss by the
context-parallel forward) and the bias update's counts are the whole batch's. The forward without labels runs whole
sequences on every cp rank; the statistics are then summed over the data-parallel ranks only.

With tensor parallelism (``tp_size > 1``, torchtitan's default layout, no tensor parallelism inside the experts):
the dense layers are split over tp by the model's plan (``sequence_parallel`` as under
:class:`~shardkit.strategies.TensorParallel`), ep is borrowed from ``dp_shard x tp``, and each tp rank dispatches its
share of the MoE layer's assignments, the outputs gathered over tp; with ``expert_tp=True`` ep is borrowed from
``dp_shard`` only and each expert's matrices are split over tp instead; see :mod:`shardkit.strategies.ep_tensor`.
With both cp and tp (EP x CP x TP), ep borrows the cp ranks too, each rank's chunk is dispatched as under tp alone
and the statistics are summed over the cp ranks of one tp coordinate (:mod:`shardkit.strategies.ep_cp_tensor`).

Pipeline parallelism with expert parallelism is the pipeline's: ``Pipeline(pp_size=..., dp="fsdp", ep_size=...)``
(:mod:`shardkit.strategies.ep_pipeline`).
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from typing_extensions import override

from shardkit.strategies import _dtensor, ep_memory
from shardkit.strategies import activation_checkpointing as checkpointing
from shardkit.strategies import fsdp as _fsdp
from shardkit.strategies.context_parallel import install_context_parallel
from shardkit.strategies.cp_attention import RingAttention, UlyssesAttention
from shardkit.strategies.ep_cp_tensor import statistics_groups
from shardkit.strategies.ep_exchange import exchange
from shardkit.strategies.ep_expert_tp import expert_tp_block, expert_tp_placement
from shardkit.strategies.ep_tensor import (
    ExpertTensorDispatch,
    TensorSplitDispatch,
    apply_tensor_parallel,
    check_expert_tp,
    check_tensor_options,
)
from shardkit.strategies.facts import MemoryJob, StateBytes
from shardkit.strategies.parallel import ProcessGroupStrategy
from shardkit.strategies.parallel_dims import CP_MODES, ParallelDims
from shardkit.utils.hf_experts import check_hf_expert_layout
from shardkit.utils.hf_token_mask import block_token_mask, record_attention_mask
from shardkit.utils.routed_rows import gather_rows, sort_assignments, sum_rows
from shardkit.utils.suggest import did_you_mean

__all__ = ["AllToAllDispatch", "ExpertParallel", "dispatch_hf_block", "hf_expert_blocks", "moe_modules"]

_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERT_SHARDING = ("full", "none")


def hf_expert_blocks(module: nn.Module) -> list[nn.Module]:
    """Hugging Face expert blocks (transformers 5's Qwen3-MoE, Qwen2-MoE, Mixtral): stacked 3-D ``gate_up_proj``
    (E, 2I, H) and ``down_proj`` (E, H, I) parameters and an ``act_fn``, called as ``(hidden, top_k_index,
    top_k_weights)``; shardkit's own experts (``weight_view``) are not among them."""
    found = []
    for m in module.modules():
        gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3 \
                and hasattr(m, "act_fn") and not hasattr(m, "weight_view"):
            found.append(m)
    return found


class _HFLocalExperts:
    """This rank's experts of a Hugging Face block, as the dispatcher calls them: ``(tokens, counts) -> outputs``."""

    def __init__(self, block: nn.Module, dispatch: AllToAllDispatch):
        self.block, self.dispatch = block, dispatch

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up = self.dispatch.weight_view(self.block.gate_up_proj).to(tokens.dtype)
        down = self.dispatch.weight_view(self.block.down_proj).to(tokens.dtype)
        outs = []
        for e, chunk in enumerate(torch.split(tokens, counts.tolist())):
            gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.block.act_fn(gate) * up, down[e]))
        return torch.cat(outs)


def _hf_expert_parallel_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
    """A Hugging Face expert block's forward under expert parallelism: the assignments sorted by expert, sent to the
    experts' ranks and back, weighted and summed per token."""
    # padding (shardkit.utils.hf_token_mask) is left out: it crosses no all-to-all and runs no expert
    order, token, counts = sort_assignments(top_k_index, self.gate_up_proj.shape[0],
                                            block_token_mask(self, top_k_index))
    self.last_load = counts.detach()
    # sums per token (and their gradients') in fp32, as the one-device routed function's
    out = self._shardkit_dispatch.run(_HFLocalExperts(self, self._shardkit_dispatch), gather_rows(hidden_states, token),
                                      counts)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return sum_rows(out, token, hidden_states)


def dispatch_hf_block(block: nn.Module, dispatch: Any) -> None:
    """Run a Hugging Face expert block (its stacked weights already split over ep) through ``dispatch``."""
    block._shardkit_dispatch = dispatch
    block.forward = types.MethodType(_hf_expert_parallel_forward, block)


def moe_modules(module: nn.Module) -> list[nn.Module]:
    """The MoE layers of ``module`` expert parallelism can split: a ``dispatcher`` slot and ``experts`` whose stacked
    weights (``gate_up_proj``, ``down_proj``) have the experts on dimension 0."""
    found = []
    for m in module.modules():
        experts = getattr(m, "experts", None)
        if hasattr(m, "dispatcher") and experts is not None and hasattr(experts, "weight_view") and all(
                isinstance(getattr(experts, w, None), nn.Parameter) for w in _EXPERT_WEIGHTS):
            found.append(m)
    return found


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class AllToAllDispatch:
    """What an MoE layer's ``dispatcher`` slot holds under expert parallelism (see the module docstring).

    Args:
        group: the ep group (ranks holding the layer's experts between them, in expert order).
        stats_group: the data-parallel ranks the routing statistics are summed over.
        grad_scale: the factor on the local experts' weight gradients (1 / ep: the ep group's ranks' losses are
            summed into them, and the replicas of the experts average them).
        unsplit_stats_group: under context parallelism, the data-parallel ranks alone: the statistics' group while
            :attr:`enabled` is off (the context-parallel forward without labels runs whole sequences on every cp
            rank, so a sum over the cp ranks would count each token once per rank). None: ``stats_group`` always.
    """

    def __init__(self, group: Any, stats_group: Any, grad_scale: float, unsplit_stats_group: Any = None):
        self.group, self.stats_group, self.grad_scale = group, stats_group, grad_scale
        self.unsplit_stats_group = unsplit_stats_group
        self.size = dist.get_world_size(group)
        self.stats_size = dist.get_world_size(stats_group)
        self.enabled = True  # the context-parallel forward turns it off around its unsplit forward

    def _stats(self) -> tuple[Any, int]:
        if self.enabled or self.unsplit_stats_group is None:
            return self.stats_group, self.stats_size
        return self.unsplit_stats_group, dist.get_world_size(self.unsplit_stats_group)

    def weight_view(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a stacked weight, with the gradient scaling above."""
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return _ScaleGrad.apply(local, self.grad_scale)

    def run(self, experts: nn.Module, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs for ``tokens`` (sorted by global expert, ``counts`` per expert), computed on the experts' ranks."""
        ranks = self.size
        per_rank = counts.numel() // ranks
        send = counts.reshape(ranks, per_rank)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)  # recv[s, j]: source s, local expert j
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = exchange(tokens, out_splits, in_splits, self.group)  # grouped by source, then expert
        block = torch.repeat_interleave(torch.arange(ranks * per_rank, device=tokens.device), recv.reshape(-1))
        by_expert = torch.sort((block % per_rank) * ranks + block // per_rank, stable=True).indices
        out = experts(received[by_expert], recv.sum(0))
        restored = out[torch.argsort(by_expert)]
        return exchange(restored, in_splits, out_splits, self.group)

    def global_sum(self, local: torch.Tensor) -> torch.Tensor:
        """The sum over the data-parallel ranks; the gradient reaches ``local`` times their number (their gradients
        are averaged afterwards, which leaves the one-device gradient)."""
        group, size = self._stats()
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        scaled = local * size
        return scaled + (total - scaled).detach()

    def global_counts(self, local: torch.Tensor) -> torch.Tensor:
        total = local.clone()
        dist.all_reduce(total, group=self._stats()[0])
        return total


class ExpertParallel(_fsdp.FSDP):
    """MoE experts split over ``ep_size`` ranks with all-to-all token dispatch; FSDP2 over the data-parallel ranks
    for the rest; with ``cp_size > 1`` each sequence split over cp ranks too (context parallelism), with
    ``tp_size > 1`` the dense layers over tp ranks (tensor parallelism, :mod:`~shardkit.strategies.ep_tensor`).

    Args:
        ep_size: ranks that split each MoE layer's experts, borrowed from dp_shard (must divide it and each layer's
            number of experts), or with cp_size > 1 from dp_shard x cp (a multiple of cp_size dividing
            dp_shard * cp_size), or with tp_size > 1 from dp_shard x tp (likewise), or with both from dp_shard x cp x tp
            (a multiple of cp_size * tp_size); with expert_tp=True tp is never borrowed; None: every one of those
            ranks.
        sharding: the dense parameters' FSDP2 mode, "full" or "grad_op" (as :class:`~shardkit.strategies.FSDP`).
        expert_sharding: how the ``dp / ep`` ranks holding the same experts hold them: "full" (FSDP2 over them)
            or "none" (whole ep slices, gradients all-reduced); see the module docstring.
        dp_replicate: replicas of the whole model (HSDP: dense parameters sharded within dp_shard and replicated
            across the replicas); ep is borrowed from dp_shard = world / (dp_replicate * cp_size).
        cp_size: ranks that split each sequence (context parallelism, as :class:`~shardkit.strategies.ContextParallel`,
            with or without tp); 1: none.
        cp_mode: with cp_size > 1, "ring" or "ulysses" attention (as ContextParallel's).
        tp_size: ranks that split the dense layers (tensor parallelism by the model's plan, as
            :class:`~shardkit.strategies.TensorParallel`); ep is then borrowed from dp_shard x tp (a multiple of
            tp_size dividing dp_shard * tp_size; with cp_size > 1 from dp_shard x cp x tp, a multiple of
            cp_size * tp_size) and each tp rank dispatches its share of the tokens; 1: none.
        sequence_parallel: with tp_size > 1, the plan's sequence-parallel form (norms and residual stream split
            over tp along the sequence).
        expert_tp: with tp_size > 1, tensor parallelism inside the experts (torchtitan's etp = tp): ep is borrowed
            from dp_shard only and each expert's gate/up projection is split by columns and its down projection by
            rows over the tp peers, each holding only its block (weights, gradients and optimizer state 1/tp;
            :class:`~shardkit.strategies.ep_tensor.ExpertTensorDispatch`, :mod:`~shardkit.strategies.ep_expert_tp`);
            False: the experts whole on their ep rank, the tp peers holding different experts.
        state_dict_type, timeout: as :class:`~shardkit.strategies.FSDP`.
    """

    def __init__(self, ep_size: int | None = None, sharding: str = "full", expert_sharding: str = "full",
                 dp_replicate: int = 1, state_dict_type: str = "sharded", timeout: float | None = None,
                 cp_size: int = 1, cp_mode: str = "ring", tp_size: int = 1, sequence_parallel: bool = False,
                 expert_tp: bool = False):
        if ep_size is not None and (isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1):
            raise ValueError(f"ExpertParallel ep_size={ep_size!r} must be an int >= 1 (None: every dp_shard rank)")
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"ExpertParallel cp_size={cp_size!r} must be an int >= 1 (1: no context parallelism)")
        if cp_mode not in CP_MODES:
            raise ValueError(f"ExpertParallel cp_mode={cp_mode!r} is not one of {CP_MODES}"
                             f"{did_you_mean(str(cp_mode), CP_MODES)}")
        if sharding not in ("full", "grad_op"):
            raise ValueError(f"ExpertParallel sharding={sharding!r}: use 'full' or 'grad_op' (replicas of the whole "
                             "model, as FSDP's 'hybrid', are dp_replicate=N)")
        if expert_sharding not in EXPERT_SHARDING:
            raise ValueError(f"ExpertParallel expert_sharding={expert_sharding!r} is not one of {EXPERT_SHARDING}"
                             f"{did_you_mean(str(expert_sharding), EXPERT_SHARDING)}")
        if isinstance(dp_replicate, bool) or not isinstance(dp_replicate, int) or dp_replicate < 1:
            raise ValueError(f"ExpertParallel dp_replicate={dp_replicate!r} must be an int >= 1")
        check_tensor_options(tp_size, sequence_parallel, expert_tp)
        super().__init__(sharding=sharding, state_dict_type=state_dict_type, timeout=timeout)
        self.sequence_parallel = sequence_parallel
        self._ep_size = ep_size
        self.expert_sharding = expert_sharding
        self.cp_mode = cp_mode
        self.dims = ParallelDims(dp_replicate=dp_replicate, cp=cp_size, tp=tp_size, ep=ep_size or 1,
                                 expert_tp=expert_tp)
        self.expert_mesh: Any = None
        self._replicated: list[nn.Parameter] = []  # expert_sharding="none": gradients all-reduced over the replicas
        self._replica_group: Any = None
        self._grad_sync = True

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @override
    def model_state_memory(self, job: MemoryJob) -> StateBytes:
        """The routed experts split over ep (FSDP2-sharded over their replicas with expert_sharding="full"), the
        dense parameters split over tp then sharded over dp_shard x cp (:mod:`~shardkit.strategies.ep_memory`)."""
        return ep_memory.expert_parallel_state(job, dp_replicate=self.dims.dp_replicate,
                                               tp=job.tp_size or self.dims.tp, ep=job.ep_size or self._ep_size,
                                               expert_sharding=self.expert_sharding, sharding=self.settings.sharding,
                                               expert_tp=self.dims.expert_tp)

    @property
    @override
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: dp_replicate * dp_shard (cp and tp peers share one)."""
        return self.world_size // (self.dims.cp * self.dims.tp)

    @property
    @override
    def data_parallel_rank(self) -> int:
        return self.rank // (self.dims.cp * self.dims.tp)  # cp and tp are the innermost dimensions

    @override
    def setup_environment(self) -> None:
        ProcessGroupStrategy.setup_environment(self)
        dims = dataclasses.replace(self.dims, dp_shard=-1, ep=1).resolve(self.world_size)
        # resolve names the fix when ep does not divide dp_shard (or, with cp, dp_shard x cp)
        borrowed = dims.cp * (1 if dims.expert_tp else dims.tp)
        self.dims = dataclasses.replace(dims, ep=self._ep_size or dims.dp_shard * borrowed).resolve(
            self.world_size)
        self.world_mesh = self.dims.build(self.device_type, names=_fsdp.MESH_DIM_NAMES)
        if self.dims.cp == 1:
            self.mesh = self.world_mesh["shard"] if self.dims.dp_replicate == 1 else \
                self.world_mesh[("replicate", "shard")]
        else:  # dense parameters sharded over dp_shard x cp, as ContextParallel's
            shard = ParallelDims.submesh(self.world_mesh, ("shard", "cp"))
            self.mesh = shard if self.dims.dp_replicate == 1 else self.world_mesh[("replicate", "shard_cp")]
        self.expert_mesh = self.dims.build_expert(self.device_type)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        layers = moe_modules(module)
        for block in hf_expert_blocks(module):
            check_hf_expert_layout(block, "ExpertParallel")
            self.dims.validate_experts(block.gate_up_proj.shape[0])
            if self.dims.expert_tp:  # its block of each expert, run by _HFLocalExperts as shardkit's experts are
                check_expert_tp(self.dims, block.down_proj.shape[2], self.expert_sharding)
        if not layers and not hf_expert_blocks(module) and self.is_global_zero:
            # A dense model has no experts to split: it trains as under FSDP (which is what its dense parts get here
            # anyway), said once so that a model built without its MoE layers by mistake does not go unnoticed.
            logging.getLogger("shardkit.strategies.expert_parallel").warning(
                "shardkit: ExpertParallel found no MoE layer in %s (a module with a `dispatcher` slot and `experts` "
                "holding stacked gate_up_proj/down_proj weights, as shardkit.models.moe.MoE): it runs as FSDP",
                type(module).__name__)
        for layer in layers:
            self.dims.validate_experts(layer.experts.gate_up_proj.shape[0])
            if self.dims.expert_tp:
                check_expert_tp(self.dims, layer.experts.down_proj.shape[2], self.expert_sharding)
        if self.dims.cp > 1:
            # The split-sequence forward first; the all-to-all dispatchers replace its statistics ones in _shard.
            cp_group = self.world_mesh["cp"].get_group()
            attention = (UlyssesAttention if self.cp_mode == "ulysses" else RingAttention)(cp_group)
            install_context_parallel(module, attention, self.dims, self.cp_mode, owner="ExpertParallel")
        return super().setup_module(module)

    def _expert_layout(self, name: str) -> tuple[Any, list[Any]]:
        """The mesh and placements of stacked expert weight ``name`` before any FSDP2 over their replicas."""
        # expert_tp: each tp peer holds its block of the same experts (shardkit.strategies.ep_expert_tp)
        tp = ("tp",) if self.dims.expert_tp else ()
        inner = [expert_tp_placement(name)] if tp else []
        if self.dims.expert_replicas > 1 and self.expert_sharding == "none":
            return (self.expert_mesh[("dp_replicate", "dp_shard_mod_ep", "ep", *tp)],
                    [Replicate(), Replicate(), Shard(0), *inner])
        if tp:
            return self.expert_mesh[("ep", "tp")], [Shard(0), *inner]
        return self.expert_mesh["ep"], [Shard(0)]

    @override
    def _shard(self, module: nn.Module) -> None:
        """The experts' stacked weights become DTensors sharded over ep (each rank keeps its slice of the copy rank
        0 broadcast, or of the replayed init), FSDP2 over their replicas for expert_sharding="full", then FSDP2's
        units over the data-parallel ranks for the rest."""
        if self.dims.tp > 1:  # the dense layers over tp first, as TensorParallel splits them
            apply_tensor_parallel(module, self.world_mesh["tp"], self.dims, self.sequence_parallel,
                                  hf_expert_blocks(module))
        ep_mesh = self.expert_mesh["ep"]
        unsplit = None
        if self.dims.cp > 1:  # the ranks with different batches: one cp coordinate's dp_replicate x dp_shard
            names = ("shard",) if self.dims.dp_replicate == 1 else ("replicate", "shard")
            unsplit = ParallelDims.submesh(self.world_mesh, names).get_group()
        dispatch: Any = AllToAllDispatch(ep_mesh.get_group(), dist.group.WORLD, 1.0 / self.dims.ep, unsplit)
        if self.dims.tp > 1:  # statistics over the ranks with other tokens: dp (x cp) of this tp coordinate
            split, whole = statistics_groups(self.world_mesh, self.dims)
        if self.dims.expert_tp:  # tp peers split each expert: an expert's group sums ep batches' gradients
            inner = AllToAllDispatch(ep_mesh.get_group(), split, 1.0 / self.dims.ep, whole)
            dispatch = ExpertTensorDispatch(inner, ep_mesh.get_group(), self.world_mesh["tp"].get_group())
        elif self.dims.tp > 1:  # tp peers split the assignments: an expert's group sums ep / tp batches' gradients
            inner = AllToAllDispatch(ep_mesh.get_group(), split, self.dims.tp / self.dims.ep, whole)
            dispatch = TensorSplitDispatch(inner, self.world_mesh["tp"].get_group())
        holders = [layer.experts for layer in moe_modules(module)] + hf_expert_blocks(module)
        experts: list[nn.Parameter] = []
        for holder in holders:
            for name in _EXPERT_WEIGHTS:
                whole = getattr(holder, name)
                per_rank = whole.shape[0] // self.dims.ep
                start = ep_mesh.get_local_rank() * per_rank
                local = whole.detach()[start:start + per_rank].clone()
                if self.dims.expert_tp:  # only this tp rank's block: 1 / tp of the weight and its optimizer state
                    local = expert_tp_block(local, name, self.world_mesh["tp"].get_local_rank(), self.dims.tp)
                mesh, placements = self._expert_layout(name)
                param = nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False,
                                                        shape=whole.shape, stride=whole.stride()),
                                     requires_grad=whole.requires_grad)
                setattr(holder, name, param)
                experts.append(param)
        for layer in moe_modules(module):
            layer.experts.weight_view = dispatch.weight_view
            layer.dispatcher = dispatch
        for block in hf_expert_blocks(module):
            block._shardkit_dispatch = dispatch
            block.forward = types.MethodType(_hf_expert_parallel_forward, block)
        record_attention_mask(module, hf_expert_blocks(module))
        blocks = self._block_classes(module)
        checkpointing.apply_activation_checkpointing(
            module, checkpointing.resolve_activation_checkpointing(self.settings.activation_checkpointing),
            default_blocks=blocks or None, owner="ExpertParallel activation_checkpointing")
        policy = _dtensor.mp_policy(self.precision)
        ignored: set[nn.Parameter] = set(experts)
        if self.dims.expert_replicas > 1 and self.expert_sharding == "full":
            # Each holder its own FSDP2 unit over the ranks holding the same experts (before its parents: bottom-up).
            names = ("dp_shard_mod_ep",) if self.dims.dp_replicate == 1 else ("dp_replicate", "dp_shard_mod_ep")
            replicas = self.expert_mesh[names[0]] if len(names) == 1 else self.expert_mesh[names]
            shards = self.expert_mesh["dp_shard_mod_ep"].size()
            for holder in holders:
                # torchtitan's rule: shard the local experts when there are enough of them, else their rows
                fully_shard(holder, mesh=replicas, reshard_after_forward=self.settings.reshard, mp_policy=policy,
                            shard_placement_fn=lambda p, n=shards: Shard(0) if
                            _dtensor.local_tensor(p).shape[0] % n == 0 else Shard(1))
            ignored = set()
        self._replicated = experts if self.dims.expert_replicas > 1 and self.expert_sharding == "none" else []
        if self._replicated:
            replicas_mesh = ParallelDims.submesh(self.expert_mesh, ("dp_replicate", "dp_shard_mod_ep"))
            self._replica_group = replicas_mesh.get_group()
        _dtensor.shard_bottom_up(module, self._wrap_targets(module, blocks), mesh=self.mesh,
                                 reshard_after_forward=self.settings.reshard, mp_policy=policy,
                                 ignored_params=ignored)

    @override
    def set_gradient_sync(self, module: nn.Module, enabled: bool) -> None:
        super().set_gradient_sync(module, enabled)
        self._grad_sync = enabled

    @override
    def backward(self, loss: torch.Tensor, module: nn.Module, accumulation_steps: int) -> None:
        super().backward(loss, module, accumulation_steps)
        if self._replicated and self._grad_sync:
            self._average_replicated_gradients()

    @torch.no_grad()
    def _average_replicated_gradients(self) -> None:
        """expert_sharding="none": each replica's gradient is its own ep group's; their mean is the whole batch's."""
        for p in self._replicated:
            if p.grad is not None:
                local = _dtensor.local_tensor(p.grad)
                dist.all_reduce(local, group=self._replica_group)
                local.div_(self.dims.expert_replicas)

    @override
    def checkpoint_info(self) -> dict[str, Any]:
        info = super().checkpoint_info()
        info.update(ep_size=self.dims.ep, expert_sharding=self.expert_sharding)
        if self.dims.cp > 1:
            info.update(cp_size=self.dims.cp, cp_mode=self.cp_mode)
        if self.dims.tp > 1:
            info.update(tp_size=self.dims.tp, sequence_parallel=self.sequence_parallel, expert_tp=self.dims.expert_tp)
        return info

    def __repr__(self) -> str:
        cp = f", cp_size={self.dims.cp}, cp_mode={self.cp_mode!r}" if self.dims.cp > 1 else ""
        if self.dims.tp > 1:
            cp += f", tp_size={self.dims.tp}, sequence_parallel={self.sequence_parallel}"
            cp += ", expert_tp=True" if self.dims.expert_tp else ""
        return (f"ExpertParallel(ep_size={self.dims.ep}{cp}, expert_sharding={self.expert_sharding!r}, "
                f"dp_replicate={self.dims.dp_replicate}, device={self._device})")
