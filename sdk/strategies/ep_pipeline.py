"""Expert parallelism inside a pipeline's stages: ``Pipeline(pp_size=2, dp="fsdp", ep_size=2)``
(``--strategy pp --strategy-opt pp_size=2 --strategy-opt dp=fsdp --strategy-opt ep_size=2``).

The mesh is :class:`~shardkit.strategies.parallel_dims.ParallelDims` with ``pp`` outermost and ``ep`` borrowed from
``dp_shard`` (torchtitan's layout: ``("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")``), so each expert
group is ranks of one pipeline stage: ranks that hold the same layers and see different batches. In each stage's MoE
layers (shardkit's :class:`~shardkit.models.moe.MoE`, found by shape as expert parallelism finds them, and Hugging
Face expert blocks, whose forward becomes expert parallelism's), the stacked
expert weights become DTensors sharded on the expert dimension over the stage's ep group and the layer's dispatcher is
expert parallelism's all-to-all (:class:`~shardkit.strategies.expert_parallel.AllToAllDispatch`); the dense parameters
are FSDP2 over the stage's ``dp_shard`` ranks, as ``Pipeline(dp="fsdp")`` shards them. With ``ep < dp_shard`` the
``dp_shard / ep`` ranks holding the same experts shard them further (each expert block its own FSDP2 unit over
``dp_shard_mod_ep``, torchtitan's layout), which averages their gradient.

Why the all-to-alls line up: every rank of a pipeline rank's ep group runs the same stages with the same schedule
(torch builds each rank's action list from its pipeline rank, the number of micro-batches and the schedule alone), so
they run the same micro-batch's forward or backward of the same stage at the same time, in the same order, including
torch's shape-inference run; zero-bubble's split backward runs the exchanges' backward in the input pass (the expert
weights' own pass holds no collective). Checked for every schedule :data:`~shardkit.strategies.pipeline.SCHEDULES`
names (tests/distributed/test_expert_parallel.py).

Gradients: each rank's loss is its own batch's share and FSDP2 averages the dense gradients over the stage's
``dp_shard`` ranks; an expert's weights see every ep rank's tokens, so their gradient is scaled by ``1 / ep`` (the
weight view), as under :class:`~shardkit.strategies.expert_parallel.ExpertParallel`. The routing statistics of each
micro-batch (its load, and the auxiliary loss's mean scores) are summed over the stage's ``dp_shard`` ranks, so each
micro-batch's auxiliary loss is that micro-batch's across the data-parallel ranks (one device's, accumulating the
same pieces) and each stage adds its layers' losses to its own backward as without experts split. The counts a bias
update reads are then the whole batch's on every rank of the stage: :class:`StageExpertDispatch` tells
:func:`~shardkit.models.moe.update_router_biases` not to sum them again (a sum over the world would pair different
layers of different stages).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from shardkit.strategies import _dtensor
from shardkit.strategies.expert_parallel import AllToAllDispatch, dispatch_hf_block, hf_expert_blocks, moe_modules
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.utils.hf_experts import check_hf_expert_layout

__all__ = ["StageExpertDispatch", "check_model_experts", "check_pipeline_experts", "shard_stage_experts"]

_WEIGHTS = ("gate_up_proj", "down_proj")


class StageExpertDispatch(AllToAllDispatch):
    """Expert parallelism's dispatcher for a pipeline stage's MoE layer: the routing statistics are summed over the
    stage's data-parallel ranks in every forward, so the bias update's counts need no further sum."""

    def reduce_counts(self, counts: torch.Tensor) -> bool:
        return True


def check_pipeline_experts(ep_size: int | None, dp: str) -> int:
    """The ep size a Pipeline runs (1: no expert parallelism), or a ValueError naming the fix.

    Raises:
        ValueError: ``ep_size`` is not a whole number >= 1, or ``ep_size > 1`` with ``dp="ddp"``.
    """
    if ep_size is None:
        return 1
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"Pipeline ep_size={ep_size!r} must be an int >= 1 (1 or None: experts whole on every "
                         "rank of a stage)")
    if ep_size > 1 and dp != "fsdp":
        raise ValueError(f"Pipeline ep_size={ep_size} with dp={dp!r}: expert parallelism inside the stages shards "
                         "the dense parameters with FSDP2 over each stage's data-parallel ranks; set dp='fsdp' "
                         f"(--strategy-opt dp=fsdp --strategy-opt ep_size={ep_size})")
    return ep_size


def check_model_experts(module: nn.Module, dims: ParallelDims, is_main: bool) -> None:
    """Before the split: every MoE layer's experts divide over ep; a model with none is said once (it trains as
    ``Pipeline(dp="fsdp")``), as ExpertParallel says it, so that a model built without its MoE layers by mistake does
    not go unnoticed.

    Raises:
        ValueError: ep does not divide a layer's number of experts.
    """
    layers = moe_modules(module)
    for layer in layers:
        dims.validate_experts(layer.experts.gate_up_proj.shape[0])
    blocks = hf_expert_blocks(module)
    for block in blocks:
        check_hf_expert_layout(block, "Pipeline(ep_size=...)")
        dims.validate_experts(block.gate_up_proj.shape[0])
    if not layers and not blocks and is_main:
        logging.getLogger("shardkit.strategies.ep_pipeline").warning(
            "shardkit: Pipeline(ep_size=%d) found no MoE layer in %s (a module with a `dispatcher` slot and `experts` "
            "holding stacked gate_up_proj/down_proj weights, as shardkit.models.moe.MoE): it runs as dp='fsdp'",
            dims.ep, type(module).__name__)


def shard_stage_experts(stage: nn.Module, dims: ParallelDims, expert_mesh: Any, stats_group: Any,
                        mp_policy: Any) -> set[nn.Parameter]:
    """Split ``stage``'s MoE experts over the ep group (see the module docstring), before the stage's dense FSDP2.

    Args:
        dims: the pipeline's resolved sizes (``ep > 1``).
        expert_mesh: :meth:`ParallelDims.build_expert`'s mesh.
        stats_group: the stage's data-parallel ranks (``dp_shard``), over which the routing statistics are summed.
        mp_policy: FSDP2's mixed-precision policy for the experts' own units (``ep < dp_shard``).

    Returns:
        The expert weights the stage's dense FSDP2 units must leave alone (empty when they are FSDP2 units of their
        own over ``dp_shard_mod_ep``).
    """
    layers = moe_modules(stage)
    blocks = hf_expert_blocks(stage)  # a Hugging Face MoE decoder's expert blocks, dispatched the same way
    if not layers and not blocks:  # a stage of dense layers only (DeepSeek's first_dense_layers)
        return set()
    ep_mesh = expert_mesh["ep"]
    dispatch = StageExpertDispatch(ep_mesh.get_group(), stats_group, 1.0 / dims.ep)
    experts: list[nn.Parameter] = []
    holders = [layer.experts for layer in layers] + blocks
    for holder in holders:
        for name in _WEIGHTS:
            whole = getattr(holder, name)
            per_rank = whole.shape[0] // dims.ep
            start = ep_mesh.get_local_rank() * per_rank
            local = whole.detach()[start:start + per_rank].clone()
            param = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                                    stride=whole.stride()), requires_grad=whole.requires_grad)
            setattr(holder, name, param)
            experts.append(param)
    for layer in layers:
        layer.experts.weight_view = dispatch.weight_view
        layer.dispatcher = dispatch
    for block in blocks:
        dispatch_hf_block(block, dispatch)
    if dims.expert_replicas == 1:
        return set(experts)
    replicas = expert_mesh["dp_shard_mod_ep"]
    shards = replicas.size()
    for holder in holders:
        # Kept whole from the first forward to the step's reduction, as the stage's dense units (pipeline.py says
        # why); torchtitan's rule for the dimension: the local experts when there are enough of them, else their rows.
        fully_shard(holder, mesh=replicas, reshard_after_forward=False, mp_policy=mp_policy,
                    shard_placement_fn=lambda p, n=shards: Shard(0) if
                    _dtensor.local_tensor(p).shape[0] % n == 0 else Shard(1))
    return set()
