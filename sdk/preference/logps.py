"""Per-sequence completion log-probabilities from one forward, without the ``[tokens, vocab]`` logits.

The model runs to its last hidden states only (a Hugging Face model with ``output_hidden_states`` and
``logits_to_keep=1``, so its head projects one position per row; shardkit's Llama with ``return_hidden=True``),
always through the set-up (wrapped) model so that the strategy's hooks run. The completion positions are then
scored against the LM head weight by :func:`shardkit.ops.linear_log_probs` (through
:func:`shardkit.nn.head_log_probs`), chunked over rows, and summed per sequence. The mean logit (TRL's
``logits/*`` metrics) is ``hidden . mean(W) + mean(b)`` (the mean of a linear map), exact and
``O(tokens x hidden)``; with a softcap, and for WPO's ``log sum p^2``, the logits are rebuilt under ``no_grad``
a bounded block of rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from shardkit.trainer.peft_support import base_model_of

__all__ = ["SequenceLogps", "lm_head_of", "sequence_log_probs", "token_log_probs"]

# Rows x vocab elements of one no-grad block (metrics only): 2^22 floats, 16 MiB in fp32.
_BLOCK_ELEMENTS = 1 << 22
_CHUNK_BYTES = 32 << 20


@dataclass
class SequenceLogps:
    """One forward's completions, each ``[sequences]`` (chosen rows first, then rejected).

    Attributes:
        logps: summed completion log-probabilities (LD-DPO weighted when ``ld_alpha`` is set), with gradient.
        sum_logps: the plain sums (no LD weighting), with gradient: ``sum_logps / tokens`` is the mean log-prob
            (ORPO, SimPO), ``-sum_logps`` the NLL (ORPO's and ``sft``'s SFT term).
        tokens: completion tokens per sequence (float).
        mean_logits: summed mean logits of the completion tokens (no gradient), or None.
        wpo_logps: WPO's per-token mean of ``log p - log sum_v p_v^2`` (no gradient), or None.
    """

    logps: Tensor
    sum_logps: Tensor
    tokens: Tensor
    mean_logits: Tensor | None = None
    wpo_logps: Tensor | None = None


def lm_head_of(model: nn.Module) -> nn.Module:
    """The output projection of a causal LM (a PeftModel's base model's)."""
    base = base_model_of(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else getattr(base, "lm_head", None)
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(base).__name__} has no LM head (get_output_embeddings() or .lm_head with a weight): "
                         "preference trainers score completions against the output projection")
    return head


def _is_shardkit_llama(module: nn.Module) -> bool:
    from shardkit.models import Llama

    return isinstance(module, Llama)


def last_hidden_states(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The final (normed) hidden states ``[rows, T, H]`` of ``batch``, through the set-up ``model``."""
    position_ids = batch.get("position_ids")
    if _is_shardkit_llama(base_model_of(unwrapped)):
        return model(batch["input_ids"], position_ids=position_ids, return_hidden=True)
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False, "output_hidden_states": True,
                              "logits_to_keep": 1, "return_dict": True}
    if batch.get("attention_mask") is not None:
        kwargs["attention_mask"] = batch["attention_mask"]
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    out = model(**kwargs)
    states = getattr(out, "hidden_states", None)
    if not states:
        raise ValueError(f"{type(base_model_of(unwrapped)).__name__} returned no hidden_states for "
                         "output_hidden_states=True: preference trainers need a Hugging Face causal LM or shardkit's "
                         "Llama")
    return states[-1]


def token_log_probs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                    softcap: float | None = None) -> Tensor:
    """``log softmax(hidden @ weight.T + bias)[labels]`` per row of ``hidden [N, H]`` without the ``[N, V]``
    logits (fp32): :func:`shardkit.nn.head_log_probs`, which gathers a ZeRO-3 head and combines a TensorParallel
    vocabulary split (and refuses an FSDP2 shard read outside the forward)."""
    from shardkit.nn.log_probs import head_log_probs

    # Rows per chunk so that one chunk's fp32 logits stay near 32 MiB whatever the vocabulary (the op's default
    # budget is 256 MiB): the logits are what preference training would otherwise spend its memory on.
    rows = max(16, _CHUNK_BYTES // (4 * max(weight.shape[0], 1)))
    return head_log_probs(hidden, weight, labels, bias=bias, softcap=softcap, chunk_size=rows).float()


@torch.no_grad()
def _logit_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None,
                 need_sq: bool) -> tuple[Tensor, Tensor | None]:
    """Per row: the mean logit over the vocabulary, and ``log sum_v p_v^2`` when ``need_sq``."""
    if softcap is None and not need_sq:
        mean = hidden.float() @ weight.float().mean(0)
        return (mean + bias.float().mean()) if bias is not None else mean, None
    rows = max(1, _BLOCK_ELEMENTS // max(weight.shape[0], 1))
    means, squares = [], []
    for i in range(0, hidden.shape[0], rows):
        logits = (hidden[i:i + rows] @ weight.t()).float()
        if bias is not None:
            logits += bias.float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        means.append(logits.mean(1))
        if need_sq:
            squares.append(torch.logsumexp(2 * logits, 1) - 2 * torch.logsumexp(logits, 1))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    return (torch.cat(means) if means else empty), ((torch.cat(squares) if squares else empty) if need_sq else None)


def _completion_positions(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(mask over the predicting positions ``[rows, T-1]``, their labels, the sequence index of each scored token).

    Padded rows are sequences; a padding-free row holds several, told apart by ``position_ids`` restarting at 0
    (a position that starts a sequence never scores from the previous one)."""
    ids, completion = batch["input_ids"], batch["completion_mask"].bool()
    mask = completion[:, 1:]
    position_ids = batch.get("position_ids")
    if position_ids is not None and batch.get("packed_sequences") is not None:
        starts = position_ids == 0
        mask = mask & ~starts[:, 1:]
        sequence = (starts.reshape(-1).long().cumsum(0) - 1).reshape(ids.shape)[:, 1:]
    else:
        sequence = torch.arange(ids.shape[0], device=ids.device)[:, None].expand(-1, ids.shape[1] - 1)
    return mask, ids[:, 1:][mask], sequence[mask]


def sequence_log_probs(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor], sequences: int, *,
                       ld_alpha: float | None = None, mean_logits: bool = True, wpo: bool = False,
                       softcap: float | None = None) -> SequenceLogps:
    """Summed completion log-probs of the ``sequences`` in ``batch`` (see :func:`last_hidden_states`).

    Args:
        model: the set-up model (its forward runs the strategy's hooks); ``unwrapped``: the module inside it.
        batch: ``input_ids``, ``completion_mask`` (1 on completion tokens), optional ``attention_mask``,
            ``position_ids`` (+ ``packed_sequences``, padding-free).
        sequences: number of sequences (chosen + rejected).
        ld_alpha: LD-DPO: tokens past the shorter completion of the pair weigh ``ld_alpha``.
    """
    hidden = last_hidden_states(model, unwrapped, batch)
    mask, labels, seq = _completion_positions(batch)
    scored = hidden[:, :-1][mask]
    head = lm_head_of(unwrapped)
    weight, bias = head.weight, getattr(head, "bias", None)
    token_logps = token_log_probs(scored, weight, labels, bias=bias, softcap=softcap)
    zeros = token_logps.new_zeros(sequences)
    sums = zeros.index_add(0, seq, token_logps)
    tokens = zeros.detach().index_add(0, seq, torch.ones_like(token_logps.detach()))
    logps = sums
    if ld_alpha is not None:
        logps = zeros.index_add(0, seq, token_logps * _ld_weights(seq, tokens, ld_alpha))
    mean_sums = wpo_logps = None
    if mean_logits or wpo:
        means, squares = _logit_stats(scored.detach(), weight.detach(),
                                      None if bias is None else bias.detach(), softcap, wpo)
        if mean_logits:
            mean_sums = zeros.detach().index_add(0, seq, means)
        if wpo:
            aligned = zeros.detach().index_add(0, seq, token_logps.detach() - squares)
            wpo_logps = aligned / tokens.clamp(min=1)
    return SequenceLogps(logps, sums, tokens, mean_sums, wpo_logps)


def _ld_weights(seq: Tensor, tokens: Tensor, alpha: float) -> Tensor:
    """LD-DPO's per-token weights: 1 within the pair's shorter completion length, ``alpha`` past it."""
    half = tokens.shape[0] // 2
    shared = torch.minimum(tokens[:half], tokens[half:]).repeat(2)
    firsts = torch.cumsum(tokens, 0) - tokens  # index of each sequence's first scored token
    position = torch.arange(seq.shape[0], device=seq.device) - firsts[seq].long() + 1
    beyond = position > shared[seq]
    return torch.where(beyond, torch.full_like(position, alpha, dtype=torch.float32),
                       torch.ones_like(position, dtype=torch.float32))
