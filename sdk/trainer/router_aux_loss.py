"""A Mixture-of-Experts model's router load-balancing loss, which the TRL-named trainers (GRPO, RLOO, DPO and its
family) do not add: a run where TRL would add it is refused instead of training another objective unsaid."""

from __future__ import annotations

from torch import nn

from shardkit.models.moe import moe_layers

__all__ = ["refuse_dropped_router_aux_loss"]


def refuse_dropped_router_aux_loss(model: nn.Module, name: str, coef: float | None = None, *,
                                   has_coef_field: bool = True) -> None:
    """Raise NotImplementedError where the router loss would be expected but is not added.

    Expected: a Hugging Face MoE model (its config has ``output_router_logits``) with a non-zero
    ``router_aux_loss_coef`` of its own, which TRL adds when the trainer's ``router_aux_loss_coef`` is None (GRPO,
    RLOO, DPO) or when ``output_router_logits`` is True (trainers without the field: CPO, ORPO); shardkit's MoE
    layers with ``aux_loss_coef > 0``, whose loss the model's own training loss holds.

    Args:
        coef: the trainer config's ``router_aux_loss_coef``; 0.0 says to train without the loss (other values are
            refused by the configs).
        has_coef_field: whether the config has ``router_aux_loss_coef`` (else the fix named is the model's).
    """
    if coef is not None:
        return
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not None and hasattr(text_config, "output_router_logits"):
        model_coef = getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0
        if not (model_coef and (has_coef_field or text_config.output_router_logits)):
            return
        source = f"router_aux_loss_coef={model_coef} in {type(model).__name__}'s config"
        fix = "set router_aux_loss_coef=0.0 in the trainer's config" if has_coef_field else \
            "set output_router_logits=False in the model's config"
    else:
        model_coef = max((layer.config.aux_loss_coef for layer in moe_layers(model)), default=0.0)
        if not model_coef:
            return
        source = f"MoEConfig.aux_loss_coef={model_coef}"
        fix = "set router_aux_loss_coef=0.0 in the trainer's config" if has_coef_field else \
            "build the model with MoEConfig(aux_loss_coef=0)"
    raise NotImplementedError(f"{name}: the model is a Mixture-of-Experts whose router load-balancing loss ({source}) "
                              f"belongs in its training loss, and {name} does not add it. To train without it, {fix}")

