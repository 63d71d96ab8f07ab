"""Hugging Face MoE expert blocks run through shardkit's grouped experts, without rewriting the model.

    from shardkit.models.moe_hf import use_grouped_experts
    use_grouped_experts(model, backend="auto")   # Qwen3-MoE, Qwen2-MoE, Mixtral (transformers 5): returns the count

transformers 5 keeps a layer's experts as one module with stacked ``gate_up_proj`` (E, 2I, H) and ``down_proj``
(E, H, I) weights, called as ``experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k))``: the layout of
:class:`shardkit.models.moe_experts.GroupedExperts`. Its eager forward loops over the experts that were hit, with a
one-hot mask per expert; here the assignments are sorted by expert once and gathered, computed, weighted and summed
per token by :func:`shardkit.models.moe_experts.routed_swiglu` (which keeps about a third of the activations autograd
of the plain form keeps). The weights stay the model's own parameters, so checkpoints, optimizers
and ``save_pretrained`` see nothing new.

Padding: a call of ``model`` with an ``attention_mask`` tells its blocks which tokens are padding
(:mod:`shardkit.utils.hf_token_mask`, also under a KV cache and activation checkpointing); their assignments are
dropped before the experts, so padding runs no expert and stays out of :attr:`last_load` (a block's assignments per
expert in its last forward), and a padded row's real tokens route as they would alone. Their outputs at padding rows
are zeros. Without a mask (or with one of all ones: packed sequences) everything routes, as in transformers. The
router's aux loss is transformers' own (``output_router_logits``: its ``load_balancing_loss_func`` already leaves
padding out with the ``attention_mask``).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from shardkit.models.moe_experts import EXPERT_BACKENDS, routed_swiglu
from shardkit.utils.hf_experts import check_hf_expert_layout
from shardkit.utils.hf_token_mask import block_token_mask, record_attention_mask
from shardkit.utils.routed_rows import sort_assignments
from shardkit.utils.suggest import did_you_mean

__all__ = ["hf_expert_modules", "use_grouped_experts"]


def hf_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The expert blocks of a Hugging Face MoE model: modules with stacked 3-D ``gate_up_proj`` and ``down_proj``
    parameters and an ``act_fn``."""
    found = []
    for m in model.modules():
        gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3 \
                and hasattr(m, "act_fn"):
            found.append(m)
    return found


def _grouped_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    order, token, counts = sort_assignments(top_k_index, self.gate_up_proj.shape[0],
                                            block_token_mask(self, top_k_index))
    self.last_load = counts.detach()
    return routed_swiglu(hidden_states, token, top_k_weights.reshape(-1)[order], counts,
                         self.gate_up_proj.to(hidden_states.dtype), self.down_proj.to(hidden_states.dtype),
                         self._shardkit_backend)


def use_grouped_experts(model: nn.Module, backend: str = "auto") -> int:
    """Route every expert block of ``model`` through :func:`~shardkit.models.moe_experts.routed_swiglu`; returns how
    many blocks were patched (an instance's forward; the class is untouched).

    Raises:
        ValueError: an unknown ``backend``, a model without expert blocks, an expert activation other than SiLU
            (the grouped experts compute SwiGLU), or a block of another layout (transposed weights, biases, a norm
            after the experts: :func:`shardkit.utils.hf_experts.check_hf_expert_layout`).
    """
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"use_grouped_experts backend={backend!r} is not one of {EXPERT_BACKENDS}"
                         f"{did_you_mean(str(backend), EXPERT_BACKENDS)}")
    blocks = hf_expert_modules(model)
    if not blocks:
        raise ValueError(f"use_grouped_experts: {type(model).__name__} has no expert block (a module with stacked 3-D "
                         "gate_up_proj/down_proj parameters and an act_fn, as transformers 5's Qwen3-MoE, Qwen2-MoE "
                         "and Mixtral have)")
    for block in blocks:
        check_hf_expert_layout(block, "use_grouped_experts")
        act: Any = block.act_fn
        if not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
            raise ValueError(f"use_grouped_experts: {type(block).__name__}'s activation is {type(act).__name__}; the "
                             "grouped experts compute SwiGLU (SiLU): leave this model's experts as they are")
        block._shardkit_backend = backend
        block.forward = types.MethodType(_grouped_forward, block)
    record_attention_mask(model, blocks)
    return len(blocks)
