"""Preference losses as pure functions: sequence log-probabilities in, one loss per pair out.

Every function takes the policy's and the reference's summed log-probabilities of the chosen and rejected
completions (shape ``[pairs]``) and returns the per-pair loss (``[pairs]``); the trainer sums them and divides by
the pairs of the whole optimizer step, so that gradient accumulation and data parallelism give the big batch's
loss. The formulas and names are TRL 1.x's ``DPOTrainer`` ones (``loss_type``); ``aot`` and ``aot_unpaired`` sort
within the micro-batch, so they alone depend on how a step's pairs are split into micro-batches.

A new loss is a function with :func:`pair_loss`'s signature, registered in :data:`PAIR_LOSSES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPO_LOSS_TYPES", "PAIR_LOSSES", "PairLogps", "dpo_rewards", "pair_loss"]


@dataclass
class PairLogps:
    """Summed completion log-probabilities of a micro-batch's pairs, each ``[pairs]``.

    ``chosen_tokens``/``rejected_tokens``: completion lengths (for the length-normalised losses).
    """

    chosen: Tensor
    rejected: Tensor
    ref_chosen: Tensor
    ref_rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor


@dataclass(frozen=True)
class LossSettings:
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05


def _delta(p: PairLogps) -> Tensor:
    return (p.chosen - p.ref_chosen) - (p.rejected - p.ref_rejected)


def _sigmoid(p: PairLogps, s: LossSettings) -> Tensor:
    return -F.logsigmoid(s.beta * _delta(p))


def _hinge(p: PairLogps, s: LossSettings) -> Tensor:
    return torch.relu(1 - s.beta * _delta(p))


def _per_token_delta(p: PairLogps) -> Tensor:
    chosen = (p.chosen - p.ref_chosen) / p.chosen_tokens.clamp(min=1)
    rejected = (p.rejected - p.ref_rejected) / p.rejected_tokens.clamp(min=1)
    return chosen - rejected


def _ipo(p: PairLogps, s: LossSettings) -> Tensor:
    # Length-normalised, as TRL (confirmed with IPO's authors): beta is IPO's tau.
    return (_per_token_delta(p) - 1 / (2 * s.beta)) ** 2


def _exo_pair(p: PairLogps, s: LossSettings) -> Tensor:
    z = s.beta * _delta(p)
    eps = torch.tensor(s.label_smoothing, dtype=z.dtype, device=z.device)
    return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps)) + \
        torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(eps))


def _nca_pair(p: PairLogps, s: LossSettings) -> Tensor:
    chosen, rejected = s.beta * (p.chosen - p.ref_chosen), s.beta * (p.rejected - p.ref_rejected)
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _robust(p: PairLogps, s: LossSettings) -> Tensor:
    z, eps = s.beta * _delta(p), s.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def _bco_pair(p: PairLogps, s: LossSettings) -> Tensor:
    chosen, rejected = s.beta * (p.chosen - p.ref_chosen), s.beta * (p.rejected - p.ref_rejected)
    return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)


def _sppo_hard(p: PairLogps, s: LossSettings) -> Tensor:
    return (p.chosen - p.ref_chosen - 0.5 / s.beta) ** 2 + (p.rejected - p.ref_rejected + 0.5 / s.beta) ** 2


def _smoothed(delta: Tensor, s: LossSettings) -> Tensor:
    z = s.beta * delta
    return -F.logsigmoid(z) * (1 - s.label_smoothing) - F.logsigmoid(-z) * s.label_smoothing


def _aot(p: PairLogps, s: LossSettings) -> Tensor:
    policy = torch.sort(p.chosen - p.rejected, dim=0).values
    reference = torch.sort(p.ref_chosen - p.ref_rejected, dim=0).values
    return _smoothed(policy - reference, s)


def _aot_unpaired(p: PairLogps, s: LossSettings) -> Tensor:
    chosen = torch.sort(p.chosen - p.ref_chosen, dim=0).values
    rejected = torch.sort(p.rejected - p.ref_rejected, dim=0).values
    return _smoothed(chosen - rejected, s)


def _apo_zero(p: PairLogps, s: LossSettings) -> Tensor:
    return 1 - torch.sigmoid(s.beta * (p.chosen - p.ref_chosen)) + torch.sigmoid(s.beta * (p.rejected - p.ref_rejected))


def _apo_down(p: PairLogps, s: LossSettings) -> Tensor:
    chosen = p.chosen - p.ref_chosen
    return torch.sigmoid(s.beta * chosen) + 1 - torch.sigmoid(s.beta * (chosen - (p.rejected - p.ref_rejected)))


def _discopop(p: PairLogps, s: LossSettings) -> Tensor:
    z = s.beta * _delta(p)
    mix = torch.sigmoid(z / s.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def _sigmoid_norm(p: PairLogps, s: LossSettings) -> Tensor:
    return -F.logsigmoid(s.beta * _per_token_delta(p))


PAIR_LOSSES: dict[str, Callable[[PairLogps, LossSettings], Tensor]] = {
    "sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo, "exo_pair": _exo_pair, "nca_pair": _nca_pair,
    "robust": _robust, "bco_pair": _bco_pair, "sppo_hard": _sppo_hard, "aot": _aot, "aot_unpaired": _aot_unpaired,
    "apo_zero": _apo_zero, "apo_down": _apo_down, "discopop": _discopop, "sigmoid_norm": _sigmoid_norm,
}
# "sft" is the chosen completions' negative log-likelihood per token: not a per-pair loss (the trainer divides it by
# the step's chosen tokens), so it has no entry above.
DPO_LOSS_TYPES = (*PAIR_LOSSES, "sft")
BATCH_DEPENDENT = frozenset({"aot", "aot_unpaired"})


def pair_loss(loss_type: str, logps: PairLogps, beta: float = 0.1, label_smoothing: float = 0.0,
              discopop_tau: float = 0.05) -> Tensor:
    """The per-pair loss of ``loss_type`` (one of :data:`PAIR_LOSSES`) on ``logps``."""
    if loss_type not in PAIR_LOSSES:
        raise ValueError(f"pair_loss: {loss_type!r} is not a per-pair loss ({sorted(PAIR_LOSSES)})")
    if not math.isfinite(beta) or beta <= 0:
        raise ValueError(f"beta={beta} must be a positive number")
    return PAIR_LOSSES[loss_type](logps, LossSettings(beta, label_smoothing, discopop_tau))


def dpo_rewards(logps: PairLogps, beta: float) -> tuple[Tensor, Tensor]:
    """DPO's implicit rewards ``beta * (log pi - log pi_ref)`` of the chosen and rejected completions (detached)."""
    return (beta * (logps.chosen - logps.ref_chosen)).detach(), (beta * (logps.rejected - logps.ref_rejected)).detach()
