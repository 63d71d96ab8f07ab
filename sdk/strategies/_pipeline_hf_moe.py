"""A pipeline stage of a Hugging Face MoE decoder (Qwen3-MoE, Mixtral) whose config adds the routers'
load-balancing loss (``output_router_logits``).

transformers' loss for one forward is ``coef * E * sum_e (F_e / R) (P_e / R)`` over the routers of *every* layer
together: ``F_e`` the top-k assignments to expert e and ``P_e`` the softmax probabilities summed over all layers'
rows, ``R`` the rows of all layers (``load_balancing_loss_func``). It is not a sum of per-layer losses, so no stage
can compute its share alone. Each stage instead sums its own routers' ``F``, ``P`` and ``R`` (over its data-parallel
ranks too: one device's micro-batch is the rows every data-parallel rank holds at that position) and adds them to the
sums it received from the stage before; the vector ``[F, P, R]`` travels with the hidden states. The last stage then
holds the micro-batch's sums over all layers and computes the loss, which starts its backward there (weighted as the
micro-batch's share, as shardkit's MoE Llama's stages do); its gradient reaches each stage's ``P`` back through the
received vectors, the same channel as the hidden states' gradient. ``F`` carries no gradient (top-k counts), as in
transformers.

The statistics' gradient reaching this rank's own ``P`` is scaled by the data-parallel size, which the gradients'
mean over those ranks takes back out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardkit.strategies._pipeline_models import HFStageModule, ModelLayout, StartAuxBackward
from shardkit.strategies.cp_moe import GroupStatistics

__all__ = ["HFMoEStageModule", "make_stage"]


def _router(body: nn.Module) -> tuple[type, int]:
    """The router module class and the index of its output that transformers records as ``router_logits``."""
    recorder = (getattr(type(body), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if not isinstance(target, type):
        raise ValueError(f"Pipeline: {type(body).__name__} records no router_logits (transformers' "
                         "_can_record_outputs): its router aux loss cannot be carried between stages; set "
                         "config.output_router_logits=False, or train it with FSDP or ExpertParallel")
    return target, int(getattr(recorder, "index", 0) or 0)


class HFMoEStageModule(HFStageModule):
    """One stage of an HF MoE decoder with its router aux loss: takes ``(hidden, stats)`` from the stage before (the
    first stage takes the token ids), returns ``(hidden, stats)`` (the last stage: the normed hidden states, its aux
    loss started in its backward and recorded in :attr:`aux_values`). ``stats`` is ``[F (E), P (E), R]`` in fp32.

    Args:
        body: the HF base model (its ``rotary_emb`` and its recorded router class).
        config: the model's config (``num_experts`` or ``num_local_experts``, ``num_experts_per_tok``,
            ``router_aux_loss_coef``).
        stats_group: the stage's data-parallel ranks; None: this rank alone.
    """

    def __init__(self, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module | None,
                 head: nn.Module | None, body: nn.Module, config: Any, stats_group: Any = None):
        super().__init__(embed, layers, norm, head, body.rotary_emb, config)
        self.num_experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        self.top_k, self.coef = int(config.num_experts_per_tok), float(config.router_aux_loss_coef)
        size = torch.distributed.get_world_size(stats_group) if stats_group is not None else 1
        self._sum = GroupStatistics(stats_group, grad_scale=float(size)) if size > 1 else None
        router, index = _router(body)
        self._logits: list[torch.Tensor] = []
        for module in self.layers.modules():
            if isinstance(module, router):
                module.register_forward_hook(lambda m, a, out, i=index: self._logits.append(out[i]))

    def forward(self, x: torch.Tensor, stats: torch.Tensor | None = None) -> Any:
        self._logits.clear()
        h = self.decode(x)
        mine = self._stage_stats(h)
        self._logits.clear()
        stats = mine if stats is None else stats + mine
        if self.norm is None:
            return h, stats
        out = self.norm(h)
        if not torch.is_grad_enabled():
            return out
        e = self.num_experts
        rows = stats[2 * e]
        aux = self.coef * e * torch.sum((stats[:e].detach() / rows) * (stats[e:2 * e] / rows))
        self.aux_values.append(aux.detach())
        return StartAuxBackward.apply(out, aux, self.aux_weight)

    def _stage_stats(self, h: torch.Tensor) -> torch.Tensor:
        """``[F, P, R]`` of this stage's routers in this forward, summed over the data-parallel ranks."""
        e = self.num_experts
        counts = torch.zeros(e, dtype=torch.float32, device=h.device)
        probs = torch.zeros(e, dtype=torch.float32, device=h.device)
        rows = 0
        for logits in self._logits:
            weights = torch.softmax(logits, dim=-1)  # in the logits' dtype, summed in fp32, as transformers does
            chosen = torch.topk(weights, self.top_k, dim=-1).indices
            counts = counts + torch.bincount(chosen.reshape(-1), minlength=e).float()
            probs = probs + weights.float().sum(0)
            rows += logits.shape[0]
        local = torch.cat([counts, probs, torch.tensor([float(rows)], device=h.device)])
        return self._sum.global_sum(local) if self._sum is not None else local


def make_stage(layout: ModelLayout, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module | None,
               head: nn.Module | None, stats_group: Any = None) -> nn.Module:
    """The stage module running ``embed`` (first stage), ``layers`` and ``norm`` (last stage): an
    :class:`HFMoEStageModule` for an HF MoE decoder with its router aux loss (``stats_group``: the stage's
    data-parallel ranks, over which its routing sums are taken), else ``layout.stage(...)``."""
    if layout.router_aux:
        return HFMoEStageModule(embed, layers, norm, head, layout.body, layout.config, stats_group)
    return layout.stage(embed, layers, norm, head)
