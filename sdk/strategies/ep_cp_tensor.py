"""Expert parallelism with context AND tensor parallelism (EP x CP x TP): the process groups
:class:`~shardkit.strategies.ExpertParallel` gives its dispatchers when ``cp_size > 1`` and ``tp_size > 1``.

The mesh is ``(dp_replicate, dp_shard, cp, tp)``. Each sequence is split over the cp ranks (ring or Ulysses attention
over each rank's ``num_heads / tp`` local heads, as :class:`~shardkit.strategies.ContextParallel` with ``tp_size``),
the dense layers over the tp ranks by the model's plan, and FSDP2 shards the dense parameters over ``dp_shard x cp``
(HSDP over ``dp_replicate``). An MoE layer sees its cp chunk's tokens whole on every tp peer; the experts are split
over ep as one of the two EP x TP layouts says (:mod:`~shardkit.strategies.ep_tensor`):

- ``expert_tp=False`` (torchtitan's etp=1): ep borrows every cp and tp rank and some dp_shard ranks (ep is
  ``dp_shard_in_ep x cp x tp``, a multiple of ``cp * tp``); each tp peer dispatches its ``1 / tp`` share of its
  chunk's assignments (:class:`~shardkit.strategies.ep_tensor.TensorSplitDispatch`).
- ``expert_tp=True`` (etp = tp): ep borrows every cp rank and some dp_shard ranks of one tp coordinate (a multiple
  of cp); the tp peers hold the same experts and each computes its block of their matrices
  (:class:`~shardkit.strategies.ep_tensor.ExpertTensorDispatch`).

Why the gradients come out right with both: each rank's loss gradient is ``cp`` times its chunk's share of its
batch's loss (the context-parallel forward; FSDP2's mean over ``dp_shard x cp`` takes it back out). An expert's ep
group holds ``ep / (cp * tp)`` batches (etp=1; ``ep / cp`` with expert_tp), their chunks split over cp and, with
etp=1, their assignments over tp, so the group's sum is ``cp`` times those batches' gradient; the weight views' scale
``tp / ep`` (``1 / ep``) leaves their mean, which FSDP2 (or the all-reduce of ``expert_sharding="none"``) averages
over the ranks holding the same experts: the mean over every batch, as without cp.

The routing statistics (load, the auxiliary loss's mean scores, the bias update's counts) are summed over the ranks
holding different tokens: ``dp_replicate x dp_shard x cp`` of one tp coordinate (the tp peers route the same tokens,
so a sum over them would count each token tp times), the gradient reaching each rank's own scores times that number
(the loss's cp scaling and FSDP2's mean over ``dp_shard x cp`` make it one device's). The context-parallel forward
without labels runs whole sequences on every cp rank: its statistics are then summed over ``dp_replicate x
dp_shard`` of one cp and one tp coordinate (:func:`statistics_groups`).
"""

from __future__ import annotations

from typing import Any

from shardkit.strategies.ep_tensor import stats_group
from shardkit.strategies.parallel_dims import ParallelDims

__all__ = ["statistics_groups"]


def statistics_groups(world_mesh: Any, dims: ParallelDims) -> tuple[Any, Any]:
    """The groups an MoE layer's routing statistics are summed over under tp (``world_mesh`` named as
    ExpertParallel's: ``replicate``, ``shard``, ``cp``, ``tp``): while the sequences are split, and while they run
    whole on every cp rank (None without cp: the first group always)."""
    unsplit = stats_group(world_mesh, dims)  # this cp and tp coordinate's data-parallel ranks
    if dims.cp == 1:
        return unsplit, None
    names = ("shard", "cp") if dims.dp_replicate == 1 else ("replicate", "shard", "cp")
    return ParallelDims.submesh(world_mesh, names).get_group(), unsplit
