"""Where each tp rank's slice of an expert weight lies under tensor parallelism inside the experts
(``ExpertParallel(..., expert_tp=True)``, :class:`~shardkit.strategies.ep_tensor.ExpertTensorDispatch`).

Each tp rank holds only its block of every local expert, so the expert weights, their gradients and their AdamW state
are ``1 / tp`` per rank:

- ``gate_up_proj`` (E, 2I, H), gate rows then up rows: tp rank r holds rows ``[r I/tp, (r+1) I/tp)`` of gate AND the
  same rows of up, stacked (gate block, then up block), so the SwiGLU's ``chunk(2)`` pairs them as on one device.
  That is torch's ``_StridedShard(1, split_factor=2)``: dimension 1 cut in 2 equal parts, each part cut over tp, rank
  r taking its block of each. The shard is two boxes of the global tensor; shardkit's checkpoints, init replay and
  whole-tensor slicing read and write them box by box (:func:`shardkit.strategies._dtensor.dtensor_boxes`).
- ``down_proj`` (E, H, I): tp rank r holds columns ``[r I/tp, (r+1) I/tp)``: ``Shard(2)``, one box.

Both are sharded over ep on the expert dimension first (``Shard(0)``), and replicated over the replicas of the experts
when ``ep < dp`` (``expert_sharding="none"``). The global shapes stay the model's, so a checkpoint is one layout
whatever the ep, tp or world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["expert_tp_block", "expert_tp_placement"]


def expert_tp_placement(name: str) -> Any:
    """The tp mesh dimension's placement of stacked expert weight ``name`` ("gate_up_proj" or "down_proj")."""
    return _StridedShard(1, split_factor=2) if name == "gate_up_proj" else Shard(2)


def expert_tp_block(weight: torch.Tensor, name: str, rank: int, size: int) -> torch.Tensor:
    """Tp rank ``rank``'s block (a copy) of ``weight``, an ep rank's slice of stacked expert weight ``name``."""
    if name == "gate_up_proj":
        inter = weight.shape[1] // 2
        b = inter // size
        return torch.cat([weight[:, rank * b:(rank + 1) * b], weight[:, inter + rank * b:inter + (rank + 1) * b]],
                         dim=1)
    b = weight.shape[2] // size
    return weight[:, :, rank * b:(rank + 1) * b].clone()
