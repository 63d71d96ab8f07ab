"""Which rows of a Hugging Face MoE expert block's input are padding, so that shardkit's forwards of the block (grouped
experts, expert parallelism) route only the real tokens.

transformers 5 calls an expert block as ``experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k))``: no
attention mask reaches it, and its own forward sends padding through the experts as real tokens (compute, all-to-all
traffic under expert parallelism, the expert load). :func:`record_attention_mask` puts a forward pre-hook on the
model that hands its expert blocks, for the duration of the call, one flag per input token from the call's 2-D
``attention_mask`` (1: a real token):

- its last ``q`` columns for an input of ``q`` tokens: during generation with a KV cache the mask covers the cached
  tokens too, and the block sees only the new ones;
- none (everything routes, as without this) when no mask is given or it has no zero (packed sequences with
  ``position_ids``), for a 4-D or otherwise shaped mask, or when the block's rows are not the call's tokens (a
  context-parallel chunk, a pipeline stage's micro-batch, a direct call of an inner module).

Activation checkpointing runs a block's forward again inside the backward, after the call (and its hook) ended: a
grad-enabled forward keeps its flags, keyed by the block's rows and routing (the recompute routes alike, bit for
bit), for the recompute to find; the last few are kept per block (each one byte per token), so that forwards that are
not recomputed do not pile up.

The router's auxiliary loss is transformers' own: its ``load_balancing_loss_func`` takes the ``attention_mask`` and
leaves padding out; nothing here changes the router's logits.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["block_token_mask", "record_attention_mask"]

_MASK = "_shardkit_token_mask"
_KEPT = "_shardkit_recompute_masks"
_HOOKS = "_shardkit_mask_hooks"
_KEEP = 16  # grad-enabled forwards whose flags a block keeps for a recompute


def record_attention_mask(model: nn.Module, blocks: Iterable[nn.Module]) -> None:
    """Hand ``blocks`` (expert blocks inside ``model``) each call's per-token mask; installing again replaces the
    hooks (one pair per model)."""
    blocks = list(blocks)
    for handle in model.__dict__.pop(_HOOKS, ()):
        handle.remove()
    if not blocks:
        return

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        rows = _token_flags(module, args, kwargs)
        for block in blocks:
            block.__dict__[_MASK] = rows

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        for block in blocks:
            block.__dict__[_MASK] = None

    model.__dict__[_HOOKS] = (model.register_forward_pre_hook(before, with_kwargs=True),
                              model.register_forward_hook(after, with_kwargs=True, always_call=True))


def _token_flags(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """One bool per input token of this call (batch-major), or None: route everything."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    for name, p in inspect.signature(module.forward).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), dict):
            bound = {**bound.pop(name), **bound}  # a forward taking **kwargs (a strategy's replacement)
    mask, inputs = bound.get("attention_mask"), bound.get("input_ids")
    if inputs is None:
        inputs = bound.get("inputs_embeds")
    if not (isinstance(mask, torch.Tensor) and isinstance(inputs, torch.Tensor)) or mask.dim() != 2 \
            or inputs.dim() < 2 or mask.shape[0] != inputs.shape[0] or inputs.shape[1] > mask.shape[1]:
        return None
    flags = mask[:, mask.shape[1] - inputs.shape[1]:] != 0
    return None if bool(flags.all()) else flags.reshape(-1)


def _routing_key(top_k_index: torch.Tensor) -> tuple[int, int]:
    """The rows and a hash of the routing: equal for a forward and its recompute."""
    flat = top_k_index.reshape(-1).to(torch.int64) + 1
    # a fixed odd multiplier per position (int64 products wrap, as a hash may)
    coeff = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) * 0x5851F42D4C957F2D % (2 ** 62) | 1
    return top_k_index.shape[0], int((flat * coeff).sum())


def block_token_mask(block: nn.Module, top_k_index: torch.Tensor) -> torch.Tensor | None:
    """The flags (False: padding) for the rows of ``block``'s current forward, routed as ``top_k_index`` (N, k), or
    None when everything routes (see the module docstring)."""
    rows = block.__dict__.get(_MASK)
    if torch._C._current_graph_task_id() != -1:  # inside a backward: activation checkpointing's recompute
        kept = block.__dict__.get(_KEPT)
        return kept.get(_routing_key(top_k_index)) if kept else None  # kept: a second backward recomputes too
    if rows is None or rows.numel() != top_k_index.shape[0]:
        return None
    if torch.is_grad_enabled():
        kept = block.__dict__.setdefault(_KEPT, collections.OrderedDict())
        kept[_routing_key(top_k_index)] = rows
        while len(kept) > _KEEP:
            kept.popitem(last=False)
    return rows
