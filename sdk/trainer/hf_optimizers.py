"""The rest of Hugging Face's ``optim=`` names: torch's RMSprop and Adagrad, and the bitsandbytes family.

Registered into shardkit's optimizer registry (``shardkit.optim.register_optimizer``) when the Trainer is
imported, so ``TrainingArguments(optim="adamw_8bit")`` is checked by name when the arguments are built and
built by the registry like every other name. The bitsandbytes package is imported only when one is built
(``pip install bitsandbytes``); its embeddings are kept in 32-bit optimizer state, as Hugging Face does
(8-bit state for embedding rows is unstable). The names shardkit cannot build are in
:data:`HF_ONLY_OPTIMIZERS` with the reason and what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardkit.optim import available_optimizers, register_optimizer
from shardkit.optim.named import MissingOptimizerPackage

__all__ = ["HF_ONLY_OPTIMIZERS", "optimizer_names"]

HF_ONLY_OPTIMIZERS = {
    "adamw_torch_xla": "it runs on TPUs (torch_xla), which shardkit does not target; use adamw_torch_fused",
    "adamw_torch_npu_fused": "it runs on Ascend NPUs (torch_npu), which shardkit does not target; use "
                             "adamw_torch_fused",
    "adamw_anyprecision": "it needs torchdistx, which shardkit does not ship; for 16-bit training use bf16=True "
                          "with adamw_shardkit (fp32 master weights)",
    "adamw_torch_4bit": "shardkit has no torchao optimizers; use adamw_8bit (bitsandbytes) for low-memory state",
    "adamw_torch_8bit": "shardkit has no torchao optimizers; use adamw_8bit (bitsandbytes)",
    "apollo_adamw": "shardkit has no APOLLO optimizer; galore_adamw projects gradients the same way",
    "apollo_adamw_layerwise": "shardkit has no APOLLO optimizer; use galore_adamw_layerwise",
    "stable_adamw": "shardkit has no torch-optimi optimizers; use adamw_torch_fused (max_grad_norm clips)",
}

# name -> (bitsandbytes class, kind of hyperparameters it takes)
_BNB = {
    "adamw_bnb_8bit": ("AdamW8bit", "adam"), "adamw_8bit": ("AdamW8bit", "adam"),
    "paged_adamw_32bit": ("PagedAdamW32bit", "adam"), "paged_adamw_8bit": ("PagedAdamW8bit", "adam"),
    "ademamix": ("AdEMAMix", "ademamix"), "ademamix_8bit": ("AdEMAMix8bit", "ademamix"),
    "paged_ademamix_32bit": ("PagedAdEMAMix", "ademamix"), "paged_ademamix_8bit": ("PagedAdEMAMix8bit", "ademamix"),
    "lion_8bit": ("Lion8bit", "lion"), "lion_32bit": ("Lion32bit", "lion"),
    "paged_lion_32bit": ("PagedLion32bit", "lion"), "paged_lion_8bit": ("PagedLion8bit", "lion"),
    "rmsprop_bnb": ("RMSprop", "rmsprop"), "rmsprop_bnb_8bit": ("RMSprop8bit", "rmsprop"),
    "rmsprop_bnb_32bit": ("RMSprop32bit", "rmsprop"),
}


def _hyperparameters(kind: str, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Trainer passes ``lr`` (and betas/eps for names with "adam"); each family takes its own set."""
    kwargs = dict(kwargs)
    betas = (args.adam_beta1, args.adam_beta2) if args is not None else kwargs.get("betas", (0.9, 0.999))
    if kind == "ademamix":
        kwargs.setdefault("betas", (*betas[:2], 0.9999))
        if args is not None:
            kwargs.setdefault("eps", args.adam_epsilon)
    elif kind == "lion":
        kwargs.setdefault("betas", betas)
        kwargs.pop("eps", None)
    elif kind == "rmsprop":
        kwargs.pop("betas", None)
    return kwargs


def _bnb_factory(name: str, cls_name: str, kind: str):
    def make(params: Any, *, model: nn.Module | None = None, training_args: Any = None, **kwargs: Any):
        try:
            import bitsandbytes.optim as bnb_optim
        except ImportError as err:
            raise MissingOptimizerPackage(f"optim={name!r} needs the package 'bitsandbytes', which is not "
                                          "installed: pip install bitsandbytes") from err
        optimizer = getattr(bnb_optim, cls_name)(params, **_hyperparameters(kind, training_args, kwargs))
        if model is not None:
            manager = bnb_optim.GlobalOptimManager.get_instance()
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    manager.register_module_override(module, "weight", {"optim_bits": 32})
        return optimizer

    make.__name__ = f"make_{name}"
    return make


def _register() -> None:
    have = set(available_optimizers())
    torch_ones = {"rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}
    for name, factory in torch_ones.items():
        if name not in have:
            register_optimizer(name, factory)
    for name, (cls_name, kind) in _BNB.items():
        if name not in have:
            register_optimizer(name, _bnb_factory(name, cls_name, kind))


def optimizer_names() -> list[str]:
    """Every ``optim=`` name shardkit builds (its registry, these included), sorted."""
    return available_optimizers()


_register()
