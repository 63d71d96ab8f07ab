"""The causal-LM loss of Hugging Face ``*ForCausalLM`` models through the fused linear cross-entropy.

Used by :func:`shardkit.nn.apply_fused_kernels`: the patched forward computes the loss straight from the last
hidden states and the ``lm_head`` weight, chunk by chunk, so the (tokens, vocab) logits never exist.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = ["causal_lm_forward", "fused_causal_lm_loss"]


def _keep_positions(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """The positions ``logits_to_keep`` selects, as transformers' models read it: an int keeps the last ``keep``
    (0: all), a 1-D tensor indexes positions, a 2-D integer tensor indexes per sample, a 2-D bool tensor masks
    (flattened). Ours because transformers' ``slice_logits_to_keep`` is missing from some 5.x releases (5.17
    on the GPU machine: the fused loss failed to import there)."""
    if isinstance(keep, torch.Tensor) and keep.ndim == 2:
        if keep.dtype == torch.bool:
            return hidden[keep]
        return torch.take_along_dim(hidden, keep[..., None], dim=1)
    return hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]


def fused_causal_lm_loss(hidden: Tensor, lm_head: nn.Module, labels: Tensor | None = None,
                         shift_labels: Tensor | None = None, num_items_in_batch: Tensor | int | None = None,
                         ignore_index: int = -100, logit_softcap: float | None = None) -> Tensor:
    """Hugging Face's ``ForCausalLMLoss`` on ``lm_head(hidden)`` without materialising the logits.

    Same semantics as transformers' ``ForCausalLMLoss``: labels are shifted left by one (the last position gets
    ``ignore_index``) unless ``shift_labels`` is given; with ``num_items_in_batch`` (gradient accumulation) the
    loss is ``sum / num_items_in_batch``, else the mean over non-ignored tokens. The loss is computed and
    returned in fp32 like HF's, which upcasts the 16-bit logits (a 16-bit loss would be quantised in bf16, and
    an fp16 sum over many tokens overflows).

    Args:
        hidden: (B, T, H) last hidden states (after ``logits_to_keep`` slicing).
        lm_head: the output projection (``nn.Linear``, weight (V, H), optional bias).
        labels: (B, T) token ids, shifted here.
        shift_labels: (B, T) already-shifted labels (HF's context-parallel path); wins over ``labels``.
        num_items_in_batch: token count across the accumulated micro-batches.
        ignore_index: label to skip.
        logit_softcap: Gemma 2/3's ``final_logit_softcapping``.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("fused_causal_lm_loss: pass labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if shift_labels.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_causal_lm_loss: labels {tuple(shift_labels.shape)} do not match the hidden states "
                         f"{tuple(hidden.shape[:-1])} (after logits_to_keep); pass labels for the kept positions")
    reduction = "sum" if num_items_in_batch is not None else "mean"
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    # The head's weight is read here, not through lm_head's forward, so an engine that partitions parameters
    # in place (ZeRO-3) and gathers them in hooks around each module's forward would not gather it: ask the
    # strategies' interface to, on every rank, read-only (a no-op for whole parameters; no engine is imported).
    # Imported here so that importing shardkit.nn does not load the strategies.
    from ..utils.partitioned import gathered_for_read

    with gathered_for_read(weight, bias):
        loss = fused_linear_cross_entropy(hidden, weight, shift_labels.to(hidden.device), bias,
                                          ignore_index=ignore_index, reduction=reduction, logit_softcap=logit_softcap)
    loss = loss.float()  # HF's loss is fp32 for a float64 model too (the fused op keeps float64 there)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def causal_lm_forward(self: nn.Module, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                      position_ids: Tensor | None = None, past_key_values: Any = None,
                      inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                      logits_to_keep: int | Tensor = 0, **kwargs: Any) -> Any:
    """``*ForCausalLM.forward`` with the fused loss; bound to one model instance by ``apply_fused_kernels``.

    Without labels this is the model's own forward (logits, softcapping, generation all unchanged). With labels
    (or ``shift_labels``) the loss comes from :func:`fused_causal_lm_loss` and ``logits`` is None: the whole
    point is that the (B, T, V) logits are never computed.
    """
    shift_labels = kwargs.pop("shift_labels", None)
    if labels is None and shift_labels is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                  **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    return_dict = kwargs.pop("return_dict", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = _keep_positions(outputs.last_hidden_state, logits_to_keep)
    loss = fused_causal_lm_loss(hidden, self.lm_head, labels=labels, shift_labels=shift_labels,
                                num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                                logit_softcap=getattr(self.config, "final_logit_softcapping", None))
    out = CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                 hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return out if return_dict else out.to_tuple()
