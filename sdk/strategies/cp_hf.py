"""Context parallelism for Hugging Face decoders (Llama, Qwen2 and others that dispatch attention through
``ALL_ATTENTION_FUNCTIONS``): their attention is routed to shardkit's ring/Ulysses attention during a
context-parallel forward, the way :func:`shardkit.nn.patching.apply_fused_kernels` swaps in fused kernels.

During the split forward the model's ``config._attn_implementation`` names ``"shardkit_cp"`` (registered once
with transformers' attention and mask interfaces; the mask is built by position inside the attention, so no
mask tensor is made), the rotary embedding gets each token's place in the whole sequence through
``position_ids``, and the loss is the whole sequences' token-weighted mean (see context_parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NAME", "hf_attention_modules", "hf_split_forward", "is_hf_decoder"]

NAME = "shardkit_cp"
_registered = False


def is_hf_decoder(module: nn.Module) -> bool:
    cfg = getattr(module, "config", None)
    return cfg is not None and hasattr(cfg, "_attn_implementation") and callable(getattr(module, "get_decoder", None))


def hf_attention_modules(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "q_proj") and hasattr(m, "o_proj") and hasattr(m, "scaling")]


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    core = module._shardkit_cp_core
    if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"ContextParallel: {type(module).__name__} scales attention by {scaling}, not "
                         f"1/sqrt(head_dim); context-parallel attention supports the standard scaling only")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each query head's key/value head
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return core(query, key, value, dropout).transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # causality by position inside the attention: no mask tensor


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _no_mask)
        _registered = True


def install_hf(module: nn.Module, attention: Any) -> None:
    """Give each attention layer of ``module`` the context-parallel attention to call during a split forward."""
    _register()
    for attn in hf_attention_modules(module):
        attn._shardkit_cp_core = attention


@contextlib.contextmanager
def _routed(module: nn.Module) -> Iterator[None]:
    cfg = module.config
    before = cfg._attn_implementation
    cfg._attn_implementation = NAME
    try:
        yield
    finally:
        cfg._attn_implementation = before


def hf_split_forward(model: nn.Module, input_ids: torch.Tensor, shifted_labels: torch.Tensor,
                     positions: torch.Tensor, attention_mask: torch.Tensor | None,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(sum of this rank's token losses, its token count, the model's output) for the local chunks."""
    from shardkit.strategies.cp_attention import shard_sequence

    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("ContextParallel: padded sequences (an attention_mask with zeros) are not supported over "
                         "a split sequence; pack the batch to full-length sequences (or pass no attention_mask)")
    local_ids = shard_sequence(input_ids, positions)
    with _routed(model):
        out = type(model).forward(model, input_ids=local_ids, position_ids=positions[None].expand(len(local_ids), -1),
                                  use_cache=False, **kwargs)
    logits = out.logits
    local_labels = shard_sequence(shifted_labels, positions).reshape(-1)
    count = (local_labels != -100).sum()
    local_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), local_labels, ignore_index=-100,
                                reduction="sum")
    return local_sum, count, out
