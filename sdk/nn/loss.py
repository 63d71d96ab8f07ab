"""FusedLinearCrossEntropyLoss: the lm_head projection and cross-entropy in one op, without the logits."""

from __future__ import annotations

import torch
from torch import Tensor

from shardkit.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = ["FusedLinearCrossEntropyLoss"]


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """``cross_entropy(hidden @ weight.T + bias, labels)`` computed chunk by chunk (see shardkit.ops).

    The module holds no parameters: the projection weight (usually ``model.lm_head.weight``) is passed at call
    time so that tied or sharded heads keep owning it. The loss is fp32 whatever the input dtypes (hidden and
    weight may differ, e.g. bf16 activations with an fp32 head; autocast sets the matmuls' dtype).

    Args:
        ignore_index: label value whose rows contribute nothing.
        reduction: "mean", "sum" or "none".
        label_smoothing: as in torch.nn.CrossEntropyLoss.
        logit_softcap: optional ``softcap * tanh(logits / softcap)`` (Gemma 2).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 logit_softcap: float | None = None) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_softcap = logit_softcap

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        """Loss of ``hidden`` (..., H) projected by ``weight`` (V, H) against ``labels`` (...)."""
        return fused_linear_cross_entropy(hidden, weight, labels, bias, ignore_index=self.ignore_index,
                                          reduction=self.reduction, label_smoothing=self.label_smoothing,
                                          logit_softcap=self.logit_softcap)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, logit_softcap={self.logit_softcap}")
