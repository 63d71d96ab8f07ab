"""CPO's losses (Contrastive Preference Optimization, https://huggingface.co/papers/2401.08417), SimPO's
(https://huggingface.co/papers/2405.14734) and AlphaPO's reward shaping, and their settings.

No reference model: the margin is between the policy's own log-probabilities of the chosen and rejected completions
(summed, or length-averaged for ``"ipo"`` and ``"simpo"``), plus ``cpo_alpha`` times the chosen completions' NLL
(a behaviour-cloning term; ``cpo_alpha=0`` is plain SimPO). Names and meanings are TRL's ``CPOTrainer``/
``CPOConfig`` (``trl.experimental``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardkit.preference._family_config import check_choice, check_positive
from shardkit.preference.orpo import check_decoder_only_settings
from shardkit.trainer.arguments import TrainingArguments

__all__ = ["CPOConfig", "CPO_LOSS_TYPES", "cpo_loss"]

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
# "alphapo" is TRL's shorthand for SimPO with AlphaPO's reward shaping and no NLL term; CPOConfig rewrites it.
_CONFIG_LOSS_TYPES = (*CPO_LOSS_TYPES, "alphapo")


def averages_logps(loss_type: str) -> bool:
    """Whether the loss compares length-averaged log-probs (IPO, SimPO) instead of summed ones."""
    return loss_type in ("ipo", "simpo")


def cpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
             alpha: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair CPO/SimPO losses and the rewards.

    Args:
        chosen_logps, rejected_logps: ``[pairs]`` completion log-probs of the policy: summed for ``"sigmoid"`` and
            ``"hinge"``, length-averaged for ``"ipo"`` and ``"simpo"`` (see :func:`averages_logps`).
        beta: the inverse temperature of the margin (for ``"ipo"``, the regularisation tau).
        loss_type: one of :data:`CPO_LOSS_TYPES`.
        label_smoothing: the assumed probability that a pair's preference is flipped (``"sigmoid"``, ``"simpo"``).
        simpo_gamma: SimPO's target reward margin (``"simpo"`` only).
        alpha: AlphaPO's reward shape: 0 uses the log-probs as rewards, otherwise ``(1 - p^-alpha) / alpha``.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``; the rewards are ``beta`` times the (shaped) log-probs,
        detached. The trainer's loss is ``losses.mean() + cpo_alpha * nll``.
    """
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"cpo_loss: loss_type={loss_type!r} is not one of {list(CPO_LOSS_TYPES)}")
    if alpha != 0.0:
        chosen_scores = (1 - torch.exp(chosen_logps).pow(-alpha)) / alpha
        rejected_scores = (1 - torch.exp(rejected_logps).pow(-alpha)) / alpha
    else:
        chosen_scores, rejected_scores = chosen_logps, rejected_logps
    logits = chosen_scores - rejected_scores
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            logits = logits - simpo_gamma / beta
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:  # ipo: Eq. (17) of https://huggingface.co/papers/2310.12036, beta is tau
        losses = (logits - 1 / (2 * beta)) ** 2
    return losses, beta * chosen_scores.detach(), beta * rejected_scores.detach()


@dataclass
class CPOConfig(TrainingArguments):
    """Settings of a :class:`~shardkit.preference.CPOTrainer` run: every TrainingArguments field plus TRL's CPO ones.

        loss_type: ``"sigmoid"`` (CPO), ``"hinge"``, ``"ipo"``, ``"simpo"``, or ``"alphapo"`` (read as
            ``"simpo"`` with ``cpo_alpha=0``, as TRL; set ``alpha`` for the reward shape).
        beta: the inverse temperature of the margin (default 0.1).
        label_smoothing: for ``"sigmoid"``/``"simpo"`` (refused with ``"hinge"``/``"ipo"``, where TRL ignores it).
        cpo_alpha: the weight of the chosen completions' NLL (default 1.0).
        simpo_gamma: SimPO's target reward margin (default 0.5).
        alpha: AlphaPO's reward shape (default 0: log-prob rewards).
        max_length: tokens kept per sequence (prompt + completion): the completion is cut to fit, the prompt never;
            a prompt that alone fills ``max_length`` is an error naming the row. None: 512, as TRL.
        disable_dropout, model_init_kwargs, trust_remote_code, dataset_num_proc: as :class:`ORPOConfig`.
        max_completion_length, is_encoder_decoder, generate_during_eval: not supported (must stay unset).
    """

    # Not settings (no annotation, so no dataclass field): what the shared PreferenceTrainer reads of DPO's data
    # options. These trainers cut and pad their rows as TRL's do (see max_length), never padding-free.
    truncation_mode = "keep_start"
    padding_free = False

    learning_rate: float = 1e-6  # TRL's default for CPO
    max_length: int | None = 1024
    max_completion_length: int | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"
    disable_dropout: bool = True
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0
    generate_during_eval: bool = False
    is_encoder_decoder: bool | None = None
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    dataset_num_proc: int | None = None

    def __post_init__(self) -> None:
        check_choice(self, "loss_type", _CONFIG_LOSS_TYPES)
        if self.loss_type == "alphapo":
            self.loss_type, self.cpo_alpha = "simpo", 0.0
        super().__post_init__()
        check_positive(self, "beta")
        if not 0.0 <= self.label_smoothing <= 0.5:
            raise ValueError(f"CPOConfig.label_smoothing={self.label_smoothing} must be in [0, 0.5]")
        if self.label_smoothing > 0 and self.loss_type in ("hinge", "ipo"):
            raise ValueError(f"CPOConfig.label_smoothing={self.label_smoothing} does nothing with loss_type="
                             f"{self.loss_type!r} (TRL ignores it there): set label_smoothing=0.0, or use "
                             "loss_type='sigmoid' or 'simpo'")
        if self.cpo_alpha < 0:
            raise ValueError(f"CPOConfig.cpo_alpha={self.cpo_alpha} must be >= 0")
        check_decoder_only_settings(self)
