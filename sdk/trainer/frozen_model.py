"""A frozen second model beside the trained one (a preference or RL trainer's reference), held as the strategy
holds models: sharded like the policy where the strategy partitions parameters (ZeRO-3, FSDP, TP: never a whole
copy per rank), replicated on the device otherwise."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

__all__ = ["frozen_model_context", "set_up_frozen_model"]


def set_up_frozen_model(runner: Any, model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Freeze ``model`` (eval, no gradients) and set it up under ``runner``; returns (what to call, the module
    inside it)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if runner.strategy.partitions_parameters:
        held = runner.setup(model)
        return held, runner.unwrap_model(held)
    model = model.to(runner.device)
    return model, model


def frozen_model_context(runner: Any) -> AbstractContextManager:
    """What a forward of the frozen model runs under: a replicated model is not wrapped by the Runner, so the
    precision's autocast is entered here; a set-up one brings its own."""
    return nullcontext() if runner.strategy.partitions_parameters else runner.autocast()
