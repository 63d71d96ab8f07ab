"""Per-token log-probabilities (and entropies) of generated completions, without the ``[tokens, vocab]`` logits.

The set-up model runs to its last hidden states (:func:`shardkit.preference.logps.last_hidden_states`, so the
strategy's hooks run); the positions that predict a completion token are scored against the LM head by
:func:`shardkit.nn.head_log_probs` at the sampling temperature (``softmax(logits / T)``, as TRL scores them), which
gathers a ZeRO-3 head and combines a TensorParallel vocabulary split. Only the tokens of ``completion_mask`` are
scored; the others hold 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from shardkit.nn.log_probs import head_log_probs
from shardkit.preference.logps import last_hidden_states, lm_head_of

__all__ = ["completion_log_probs"]

# One chunk's fp32 logits near 32 MiB whatever the vocabulary (the logits are what RL training would otherwise
# spend its memory on).
_CHUNK_BYTES = 32 << 20


def completion_log_probs(model: nn.Module, unwrapped: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                         completion_ids: Tensor, completion_mask: Tensor, temperature: float = 1.0,
                         entropy: bool = False, batch_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """``(logps [B, C], entropy [B, C] or None)`` of the completion tokens given their left-padded prompts.

    Args:
        model: the set-up model; ``unwrapped``: the module inside it.
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts and their attention mask.
        completion_ids, completion_mask: ``[B, C]`` right-padded completions and the tokens that count.
        entropy: also return the entropy of each scored position's distribution (detached).
        batch_size: rows per forward (default all): bounds the activations of the no-grad passes.
    """
    rows = completion_ids.shape[0]
    step = batch_size or max(rows, 1)
    logps, entropies = [], []
    for start in range(0, max(rows, 1), step):
        part = slice(start, start + step)
        lp, ent = _score(model, unwrapped, prompt_ids[part], prompt_mask[part], completion_ids[part],
                         completion_mask[part], temperature, entropy)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), (torch.cat(entropies) if entropy else None)


def _score(model: nn.Module, unwrapped: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
           completion_mask: Tensor, temperature: float, entropy: bool) -> tuple[Tensor, Tensor | None]:
    batch = {"input_ids": torch.cat([prompt_ids, completion_ids], 1),
             "attention_mask": torch.cat([prompt_mask, completion_mask], 1)}
    hidden = last_hidden_states(model, unwrapped, batch)
    width = completion_ids.shape[1]
    start = prompt_ids.shape[1] - 1  # the position that predicts the first completion token
    mask = completion_mask.bool()
    scored = hidden[:, start:start + width][mask]
    head = lm_head_of(unwrapped)
    chunk = max(16, _CHUNK_BYTES // (4 * max(head.weight.shape[0], 1)))
    labels = completion_ids[mask]

    def score(states: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        return head_log_probs(states, head.weight, labels, bias=getattr(head, "bias", None), temperature=temperature,
                              return_entropy=entropy, chunk_size=chunk)

    out = _as_head_forward(head, score, scored)
    token_logps, token_entropy = out if entropy else (out, None)
    logps = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, token_logps.float())
    dense = None
    if token_entropy is not None:
        dense = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        dense = dense.masked_scatter(mask, token_entropy.detach().float())
    return logps, dense


def _as_head_forward(head: nn.Module, score: Callable[[Tensor], Any], hidden: Tensor) -> Any:
    """``score(hidden)`` run as the head module's forward, so that an engine that gathers a module's parameters
    around its forward and again for its backward (ZeRO-3's hooks) holds the head's weight for the op's backward
    too: a gather for the call alone would leave the backward an empty partition."""
    head.forward = score  # an instance attribute shadows the class's forward for this one call
    try:
        return head(hidden)
    finally:
        del head.forward
