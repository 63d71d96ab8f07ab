"""Mixture-of-experts layers under strategies that split one batch's tokens across ranks without splitting the
experts: context parallelism (each cp rank routes its chunk of every sequence) and pipelines (each stage holds some
of the layers, each micro-batch routes apart).

Routing is per token, so each rank runs every expert on its own tokens; only the routing statistics need the other
ranks. The load-balancing loss ``coef * sum_e f_e * P_e`` and the aux-loss-free bias update are functions of the
whole batch's per-expert load and mean scores, which are not sums of per-chunk losses. :class:`GroupStatistics`,
installed in each MoE layer's ``dispatcher`` slot (the hook shardkit's :class:`~shardkit.models.moe.MoE` reads, found
by that slot and never by importing the model), sums the statistics over the ranks that hold the chunks, so the
loss and the load are the whole sequence's on every rank.

The layers are found by their shape, as expert parallelism finds them: a ``dispatcher`` slot next to an ``aux_loss``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GroupStatistics", "install_statistics", "moe_aux_loss", "statistics_layers"]


def statistics_layers(module: nn.Module) -> list[nn.Module]:
    """The MoE layers of ``module`` whose routing statistics a strategy may reduce (``dispatcher`` and ``aux_loss``)."""
    return [m for m in module.modules() if hasattr(m, "dispatcher") and hasattr(m, "aux_loss")]


def moe_aux_loss(layers: list[nn.Module]) -> torch.Tensor | None:
    """The sum of ``layers``' auxiliary losses from their last training forward (at least fp32), or None."""
    losses = [m.aux_loss for m in layers if m.aux_loss is not None]
    if not losses:
        return None
    return torch.stack([loss.float() if loss.dtype.itemsize < 4 else loss for loss in losses]).sum()


class GroupStatistics:
    """A ``dispatcher`` for an MoE layer whose experts are all on this rank and whose tokens are split over ``group``.

    Args:
        group: the ranks holding the other parts of the same batch (the cp group); None: this rank holds all of it.
        grad_scale: the factor on the gradient reaching this rank's own mean scores. Under context parallelism each
            rank's loss gradient is cp times its share (FSDP2's mean over ``dp_shard x cp`` takes it back out), so
            the auxiliary loss's must be too: the group's size.
        counts_group: the ranks whose expert counts :func:`~shardkit.models.moe.update_router_biases` sums before
            it moves the bias (``reduce_counts``); None: the caller's ``all_reduce`` (the world).
    """

    # Every expert is on this rank: the layer runs its routed function as on one device (no sorted copy of the
    # tokens, no expert outputs kept for the backward; its sums over assignments in at least fp32).
    routes_locally = True

    def __init__(self, group: Any = None, grad_scale: float = 1.0, counts_group: Any = None):
        self.group, self.grad_scale, self.counts_group = group, grad_scale, counts_group
        # Off while a strategy runs the whole batch on every rank of the group (ContextParallel's unsplit forward):
        # a sum there would count each token once per rank.
        self.enabled = True

    def _reduces(self) -> bool:
        return self.enabled and self.group is not None and dist.get_world_size(self.group) > 1

    def run(self, experts: nn.Module, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(tokens, counts)

    def global_sum(self, local: torch.Tensor) -> torch.Tensor:
        """The sum over the group (the value every rank sees); the gradient reaches ``local`` times ``grad_scale``."""
        if not self._reduces():
            return local
        total = local.detach().clone()
        dist.all_reduce(total, group=self.group)
        scaled = local * self.grad_scale
        return scaled + (total - scaled).detach()

    def global_counts(self, local: torch.Tensor) -> torch.Tensor:
        if not self._reduces():
            return local
        total = local.clone()
        dist.all_reduce(total, group=self.group)
        return total

    def reduce_counts(self, counts: torch.Tensor) -> bool:
        """Sum the counts a bias update reads over the ranks that saw other batches; False: leave it to the caller
        (its ``all_reduce`` over the world is right when every rank holds every MoE layer)."""
        if self.counts_group is None:
            return False
        if dist.get_world_size(self.counts_group) > 1:
            dist.all_reduce(counts, group=self.counts_group)
        return True


def install_statistics(module: nn.Module, owner: str, make: Any) -> list[nn.Module]:
    """Put ``make()`` in every MoE layer's ``dispatcher`` slot; a slot another strategy filled is refused by name."""
    layers = statistics_layers(module)
    for layer in layers:
        if layer.dispatcher is not None and not isinstance(layer.dispatcher, GroupStatistics):
            raise ValueError(f"{owner}: the MoE layer {type(layer).__name__} already has a dispatcher "
                             f"({type(layer.dispatcher).__name__}, expert parallelism's): expert parallelism does "
                             f"not compose with {owner} here; use one of them, or ExpertParallel(ep_size=..., "
                             "cp_size=...) for both")
        layer.dispatcher = make()
    return layers
