"""Per-token scores of one forward for the trainers whose losses need more than the completions' summed log-probs:
ORPO's NLL over whole sequences, CPO's length-averaged log-probs, KTO's entropy, TRL's mean-logit metrics over
positions of their choosing.

The model runs to its final hidden states through :func:`shardkit.preference.logps.last_hidden_states` (the set-up
model, so the strategy's hooks run), and the chosen positions are scored against the LM head weight by the chunked
op through :func:`shardkit.nn.head_log_probs` (which gathers a ZeRO-3 head and combines a TensorParallel vocabulary
split; the ``[tokens, vocab]`` logits never exist). The mean logit over the vocabulary is
``hidden . mean(W) + mean(b)``, the mean of a linear map, exact and ``O(positions x hidden)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from shardkit.nn.log_probs import head_log_probs
from shardkit.preference.logps import last_hidden_states, lm_head_of
from shardkit.trainer.peft_support import base_model_of
from shardkit.utils.partitioned import gathered_for_read

__all__ = ["TokenScores", "check_no_softcap", "mean_logits", "score_tokens"]

# One chunk's fp32 logits near 32 MiB whatever the vocabulary, the budget the base scores the reference with (the
# logits are what preference training would otherwise spend its memory on).
_CHUNK_BYTES = 32 << 20


@dataclass
class TokenScores:
    """One forward's scores, positions ``[rows, T-1]`` (position ``t`` predicts token ``t + 1``).

    Attributes:
        hidden: the final hidden states ``[rows, T, H]``.
        mask: the scored positions (bool).
        logps: the label's log-probability at each scored position (0 elsewhere), with gradient.
        entropy: the entropy of the next-token distribution at each scored position (0 elsewhere, no gradient),
            or None when not asked for.
    """

    hidden: Tensor
    mask: Tensor
    logps: Tensor
    entropy: Tensor | None = None

    def sums(self, mask: Tensor | None = None) -> Tensor:
        """Per row, the summed log-probs over ``mask`` (a subset of the scored positions; default all)."""
        return (self.logps * (self.mask if mask is None else mask)).sum(1)

    def sums_token_by_token(self) -> Tensor:
        """Per row, the summed log-probs added token after token, as the shared base sums the reference's: a policy
        equal to its reference then has exactly its sums (float addition depends on the order)."""
        rows = torch.arange(self.mask.shape[0], device=self.mask.device)[:, None].expand_as(self.mask)[self.mask]
        return self.logps.new_zeros(self.mask.shape[0]).index_add(0, rows, self.logps[self.mask])


def check_no_softcap(model: nn.Module, trainer: str) -> None:
    """The shared reference scoring has no final-logit softcap: a model that softcaps its logits is refused
    rather than scored on logits it never produces."""
    config = getattr(base_model_of(model), "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    if getattr(text, "final_logit_softcapping", None):
        raise NotImplementedError(f"{trainer}: {type(base_model_of(model)).__name__} softcaps its logits "
                                  "(final_logit_softcapping), which the preference trainers' log-prob scoring does "
                                  "not apply yet; use a model without it")


def score_tokens(model: nn.Module, unwrapped: nn.Module, batch: dict[str, Tensor], mask: Tensor, *,
                 entropy: bool = False) -> TokenScores:
    """Score the positions in ``mask`` (``[rows, T-1]``) of ``batch`` (``input_ids``, ``attention_mask``).

    Args:
        model: the set-up model (its forward runs the strategy's hooks); ``unwrapped``: the module inside it.
        mask: which positions to score: position ``t`` scores token ``t + 1``.
        entropy: also return the per-position entropy (for metrics; detached).
    """
    hidden = last_hidden_states(model, unwrapped, batch)
    mask = mask.bool()
    head = lm_head_of(unwrapped)
    labels = batch["input_ids"][:, 1:][mask]
    chunk = max(16, _CHUNK_BYTES // (4 * max(head.weight.shape[0], 1)))
    out = head_log_probs(hidden[:, :-1][mask], head.weight, labels, bias=getattr(head, "bias", None),
                         return_entropy=entropy, chunk_size=chunk)
    token_logps, token_entropy = out if entropy else (out, None)
    logps = token_logps.float().new_zeros(mask.shape).masked_scatter(mask, token_logps.float())
    dense_entropy = None
    if token_entropy is not None:
        dense_entropy = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        dense_entropy = dense_entropy.masked_scatter(mask, token_entropy.detach().float())
    return TokenScores(hidden, mask, logps, dense_entropy)


@torch.no_grad()
def mean_logits(hidden: Tensor, unwrapped: nn.Module) -> Tensor:
    """The mean logit over the vocabulary at each position of ``hidden [..., H]`` (fp32, no gradient).

    Every rank calls it together under ZeRO-3 and TensorParallel (the head's mean row is gathered)."""
    head = lm_head_of(unwrapped)
    bias = getattr(head, "bias", None)
    with gathered_for_read(head.weight, bias):
        row = _whole(head.weight.detach().float().mean(0))
        shift = None if bias is None else _whole(bias.detach().float().mean())
    mean = hidden.float() @ row.to(hidden.device)
    return mean if shift is None else mean + shift.to(hidden.device)


def _whole(value: Tensor) -> Tensor:
    """A DTensor's value as a plain tensor (a vocabulary-sharded head's mean is a small reduction)."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value
