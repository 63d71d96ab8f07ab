"""``runner.gather_for_metrics``: a per-sample tensor from every data-parallel rank, each sample counted once.

Held by the Runner (``runner.gathering``) with the one thing it keeps: which global rank speaks for each
data-parallel rank under model parallelism, asked once.
"""

from __future__ import annotations

from typing import Any

import torch

from shardkit.strategies.base import Strategy

__all__ = ["MetricsGather"]


class MetricsGather:
    """Gathers per-sample tensors over the data-parallel ranks of ``strategy``, without padding repeats."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self._leaders: list[int] | None = None

    def gather(self, tensor: torch.Tensor, loader: Any | None) -> torch.Tensor:
        """Every data-parallel rank's ``tensor`` concatenated in rank order; rows that ``loader``'s last batch
        repeated to pad an uneven split (its ``duplicate_mask``) are dropped."""
        gathered = self.strategy.all_gather(tensor)
        if self.strategy.data_parallel_size != self.strategy.world_size:
            # Model-parallel peers (tensor parallelism) hold the same batch: one block per data-parallel rank.
            gathered = gathered[self.data_parallel_leaders()]
        gathered = gathered.reshape(-1, *tensor.shape[1:])
        mask = loader.duplicate_mask() if loader is not None else None
        return gathered if mask is None else gathered[mask.to(gathered.device)]

    def data_parallel_leaders(self) -> list[int]:
        """For each data-parallel rank in order, the first global rank that holds it (asked once, then kept)."""
        if self._leaders is None:
            dp = torch.tensor([self.strategy.data_parallel_rank], device=self.strategy.root_device)
            first: dict[int, int] = {}
            for rank, dp_rank in enumerate(self.strategy.all_gather(dp).reshape(-1).tolist()):
                first.setdefault(dp_rank, rank)
            self._leaders = [first[r] for r in range(self.strategy.data_parallel_size)]
        return self._leaders
