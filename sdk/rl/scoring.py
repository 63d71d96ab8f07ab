"""Per-token log-probabilities (and entropies) of generated completions, without the ``[tokens, vocab]`` logits.

The prompt and completion run through the set-up model as one left-padded-prompt, right-padded-completion batch,
and the positions that predict a completion token are scored at the sampling temperature (``softmax(logits / T)``,
as TRL scores them) by :func:`shardkit.preference.logps.score_positions`, the preference trainers' one scoring
mechanism: inside the model's forward where the engine has the LM head whole only there (FSDP2's shards, ZeRO-3's
partitions, so that it gathers the head again for backward and reduces its gradient), from the last hidden states
after the forward otherwise (one device, DDP, ZeRO-1/2, TensorParallel's vocabulary split). Only the tokens of
``completion_mask`` are scored; the others hold 0.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardkit.preference.logps import score_positions

__all__ = ["completion_log_probs"]


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
    mask = completion_mask.bool()
    width, start = mask.shape[1], prompt_ids.shape[1] - 1  # position start predicts the first completion token
    positions = torch.zeros(mask.shape[0], batch["input_ids"].shape[1] - 1, dtype=torch.bool, device=mask.device)
    positions[:, start:start + width] = mask
    # score_positions orders the scored tokens row by row, as ``mask`` selects them
    token_logps, stats = score_positions(model, unwrapped, batch, positions, entropy=entropy, temperature=temperature)
    logps = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, token_logps.float())
    dense = None
    if entropy:
        dense = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        dense = dense.masked_scatter(mask, stats["entropy"].detach().float())
    return logps, dense
