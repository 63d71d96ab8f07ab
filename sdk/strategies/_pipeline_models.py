"""The models a pipeline can split, and the stage modules it builds from them (see pipeline.py).

Two layouts: shardkit's Llama (``embed_tokens``, ``layers``, ``norm``, ``lm_head`` on the model itself) and
Hugging Face decoders of :data:`HF_MODEL_TYPES` (``model.embed_tokens``, ``model.layers``, ``model.norm``,
``model.rotary_emb`` and ``lm_head``). An HF stage recomputes the causal mask and the rotary embeddings from its
input's shape, so every stage has them without sending them between ranks. An HF MoE decoder with
``output_router_logits`` also sends its routing statistics on to the next stage (:mod:`._pipeline_hf_moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.strategies.cp_moe import moe_aux_loss, statistics_layers
from shardkit.utils.suggest import did_you_mean

__all__ = ["HF_MODEL_TYPES", "HF_MOE_MODEL_TYPES", "HFStageModule", "ModelLayout", "StageModule", "StartAuxBackward",
           "UnsplittableModelError", "model_layout"]

# Decoders whose layers take (hidden, attention_mask=, position_embeddings=, position_ids=) and whose mask is one for
# every layer (causal, or the config's sliding window); hybrid-attention families need per-layer masks (not split
# yet). The MoE ones (their router aux loss carried between stages: _pipeline_hf_moe.py) in HF_MOE_MODEL_TYPES.
HF_MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
HF_MODEL_TYPES = ("llama", *HF_MOE_MODEL_TYPES)


class UnsplittableModelError(ValueError):
    """The model is not one the pipeline knows how to split into stages."""


@dataclass
class ModelLayout:
    """Where a splittable model keeps its parts.

    Attributes:
        body: the module holding ``embed_tokens``, ``layers`` and ``norm`` (the model, or an HF model's ``model``).
        config: an HF model's config (None for shardkit's Llama, whose layers need no mask or positions).
    """

    body: nn.Module
    config: Any = None

    @property
    def hf(self) -> bool:
        return self.config is not None

    @property
    def router_aux(self) -> bool:
        """An HF MoE decoder whose config adds its routers' load-balancing loss (``output_router_logits``)."""
        return self.hf and self.config.model_type in HF_MOE_MODEL_TYPES and bool(self.config.output_router_logits)

    def stage(self, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module | None,
              head: nn.Module | None) -> nn.Module:
        """The stage module running ``embed`` (first stage), ``layers`` and ``norm`` (last stage); an HF MoE decoder
        with its router aux loss is :func:`shardkit.strategies._pipeline_hf_moe.make_stage`'s."""
        if self.hf:
            return HFStageModule(embed, layers, norm, head, self.body.rotary_emb, self.config)
        return StageModule(embed, layers, norm, head)

    def head_loss(self, head: nn.Module, hidden: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``hidden`` (tokens x hidden) against ``shift`` (-100 ignored)."""
        if self.hf:
            return F.cross_entropy(head(hidden).float(), shift, ignore_index=-100)
        return head(hidden, shift)


class StartAuxBackward(torch.autograd.Function):
    """The identity on a stage's output whose backward also starts the stage's auxiliary loss's backward, with
    ``weight`` (d loss / d aux): the loss is on the last stage only, so each stage's MoE layers reach it this way."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight, ctx.aux = weight, (aux.dtype, aux.device)
        # A copy, not a view: the schedule detaches a stage's outputs in place before sending them on.
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, device = ctx.aux
        return grad, torch.full((), ctx.weight, dtype=dtype, device=device), None


class StageModule(nn.Module):
    """One stage: the embedding on the first, a block of layers, the final norm on the last.

    With MoE layers (found by shape: see cp_moe.py) each training forward adds their auxiliary loss to the
    backward, weighted by :attr:`aux_weight` (the runner sets it per step: the loss scale over the micro-batches
    and the accumulation window), and records its value in :attr:`aux_values` for the reported loss.
    """

    def __init__(self, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module | None,
                 head: nn.Module | None):
        super().__init__()
        self.embed, self.layers, self.norm, self.head = embed, nn.ModuleList(layers), norm, head
        self.moe = statistics_layers(self.layers)
        self.aux_weight = 1.0
        self.aux_values: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self._with_aux(self.norm(x) if self.norm is not None else x)

    def _with_aux(self, out: torch.Tensor) -> torch.Tensor:
        aux = moe_aux_loss(self.moe) if self.moe else None
        if aux is None or not torch.is_grad_enabled():
            return out
        self.aux_values.append(aux.detach())
        return StartAuxBackward.apply(out, aux, self.aux_weight)


class HFStageModule(StageModule):
    """A stage of an HF decoder: each stage builds the causal mask and rotary embeddings for its input."""

    def __init__(self, embed: nn.Module | None, layers: list[nn.Module], norm: nn.Module | None,
                 head: nn.Module | None, rotary: nn.Module, config: Any):
        super().__init__(embed, layers, norm, head)
        self.rotary = rotary
        self._config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.decode(x)
        return self._with_aux(self.norm(h) if self.norm is not None else h)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding (first stage) and this stage's layers, with the model's own mask (causal, or its sliding
        window when the config sets one, as the model chooses) and rotary embeddings."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        h = self.embed(x) if self.embed is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        window = getattr(self._config, "sliding_window", None)
        make_mask = create_causal_mask if window is None else create_sliding_window_causal_mask
        mask = make_mask(config=self._config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                         position_ids=position_ids)
        rotary = self.rotary(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
        return h


def _is_hf(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _missing(owner: nn.Module, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(owner, n, None) is None]


def model_layout(module: nn.Module) -> ModelLayout:
    """Where ``module``'s embedding, layers, norm and head are.

    Raises:
        UnsplittableModelError: an HF architecture outside :data:`HF_MODEL_TYPES`, or a model without the
            parts a stage is cut from (the message names what is missing).
    """
    name = type(module).__name__
    if _is_hf(module):
        model_type = str(getattr(module.config, "model_type", "?"))
        if model_type not in HF_MODEL_TYPES:
            raise UnsplittableModelError(
                f"Pipeline cannot split {name} (model_type {model_type!r}): it splits HF decoders of model_type "
                f"{', '.join(map(repr, HF_MODEL_TYPES))}{did_you_mean(model_type, HF_MODEL_TYPES)} and shardkit's "
                "Llama; train this model with FSDP or TensorParallel instead")
        body = getattr(module, "model", None)
        missing = ["model"] if body is None else _missing(body, ("embed_tokens", "layers", "norm", "rotary_emb"))
        missing += _missing(module, ("lm_head",))
        if missing:
            raise UnsplittableModelError(f"Pipeline splits an HF {model_type} causal LM (model.embed_tokens, "
                                         f"model.layers, model.norm, model.rotary_emb, lm_head); {name} has no "
                                         f"{missing}: pass the ...ForCausalLM model, not its base model")
        return ModelLayout(body, module.config)
    missing = _missing(module, ("embed_tokens", "layers", "norm", "lm_head"))
    if missing:
        raise UnsplittableModelError(f"Pipeline splits shardkit Llama-style models (embed_tokens, layers, norm, "
                                     f"lm_head) and HF decoders of model_type {', '.join(HF_MODEL_TYPES)}; {name} "
                                     f"has no {missing}")
    return ModelLayout(module)
