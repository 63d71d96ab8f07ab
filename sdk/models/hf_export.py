"""shardkit's Llama (dense or MoE) in a transformers architecture: its config.json and HF-named tensors.

    from shardkit.models.hf_export import hf_config, hf_state_dict
    hf_config(model.config)      # {"model_type": "llama" | "mixtral" | "qwen2_moe" | "glm4_moe", ...}
    hf_state_dict(model)         # the tensors transformers' model of that config holds, by its names

Which architecture a config becomes, and what is refused, is :mod:`shardkit.checkpoint.llama_hf`'s (it sits in the
checkpoint package so that zero-to-fp32 and ``convert --to hf`` map a saved checkpoint without a model). Writing a
folder ``from_pretrained`` loads is ``shardkit.checkpoint.hf.save_pretrained`` (or the Trainer's ``save_model``),
under any strategy: a shardkit Llama is written in its HF form there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardkit.checkpoint.hf import tied_aliases
from shardkit.checkpoint.llama_hf import LlamaExport
from shardkit.models.llama import LlamaConfig

__all__ = ["LlamaExport", "hf_config", "hf_export", "hf_state_dict"]


def hf_export(config: LlamaConfig | dict) -> LlamaExport:
    """The HF form of a shardkit Llama of ``config`` (a :class:`LlamaConfig` or its ``to_dict()``).

    Raises:
        CheckpointError: the config has no exact transformers equivalent (naming the field and the fix).
    """
    return LlamaExport(config.to_dict() if isinstance(config, LlamaConfig) else dict(config))


def hf_config(config: LlamaConfig | dict) -> dict[str, Any]:
    """The ``config.json`` of the transformers model equal to a shardkit Llama of ``config``."""
    return dict(hf_export(config).config)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A shardkit Llama's (unsharded) tensors under the transformers model's names, stacked experts as transformers 5
    holds them; ``model.load_state_dict(...)`` of ``AutoModelForCausalLM.from_config`` takes it (tied weights once)."""
    export = hf_export(model.config)
    tied = set(tied_aliases(model))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name not in tied:
            out.update(export.tensors(name, tensor))
    return out
