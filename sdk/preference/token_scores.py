"""Per-token scores of one forward for the trainers whose losses need more than the completions' summed log-probs:
ORPO's NLL over whole sequences, CPO's length-averaged log-probs, KTO's entropy, TRL's mean-logit metrics over
positions of their choosing.

The positions are scored by :func:`shardkit.preference.logps.score_positions`, the mechanism that scores DPO's
completions: against the LM head weight by the chunked op (the ``[tokens, vocab]`` logits never exist), after the
set-up model's forward from its last hidden states, or inside that forward where the engine has the head whole only
there (FSDP2, ZeRO-3 with a partitioned head), so that it gathers the head for backward and reduces its gradient.
The mean logit over the vocabulary is ``hidden . mean(W) + mean(b)``, the mean of a linear map, exact and
``O(positions x hidden)``, read from the detached hidden states after the forward (no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from shardkit.preference.logps import lm_head_of, score_positions
from shardkit.trainer.peft_support import base_model_of
from shardkit.utils.partitioned import gathered_for_read

__all__ = ["TokenScores", "check_no_softcap", "mean_logits", "score_tokens"]

@dataclass
class TokenScores:
    """One forward's scores, positions ``[rows, T-1]`` (position ``t`` predicts token ``t + 1``).

    Attributes:
        hidden: the final hidden states at the predicting positions ``[rows, T-1, H]`` (detached).
        mask: the scored positions (bool).
        logps: the label's log-probability at each scored position (0 elsewhere), with gradient.
        entropy: the entropy of the next-token distribution at each scored position (0 elsewhere, no gradient),
            or None when not asked for.
        last: the final hidden states at the last position ``[rows, H]`` (detached), or None where the model does
            not hand them to its head (shardkit's Llama scored inside its forward).
    """

    hidden: Tensor
    mask: Tensor
    logps: Tensor
    entropy: Tensor | None = None
    last: Tensor | None = None

    def with_last(self, trainer: str) -> Tensor:
        """The final hidden states at every position ``[rows, T, H]``, the last one included."""
        if self.last is None:
            raise NotImplementedError(
                f"{trainer}'s logits/* metrics average the mean logit over every position, the last included, which "
                "shardkit's Llama does not hand its LM head when it is scored inside its forward (FSDP, or ZeRO-3 "
                "with a partitioned head); use a Hugging Face causal LM there, or another strategy")
        return torch.cat([self.hidden, self.last[:, None]], 1)

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
    mask = mask.bool()
    token_logps, stats = score_positions(model, unwrapped, batch, mask, entropy=entropy)
    logps = token_logps.float().new_zeros(mask.shape).masked_scatter(mask, token_logps.float())
    dense_entropy = None
    if entropy:
        dense_entropy = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        dense_entropy = dense_entropy.masked_scatter(mask, stats["entropy"].detach().float())
    return TokenScores(stats["hidden"], mask, logps, dense_entropy, stats.get("last"))


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
