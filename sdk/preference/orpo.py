"""ORPO's loss (Odds Ratio Preference Optimization, https://huggingface.co/papers/2403.07691) and its settings.

ORPO needs no reference model: the loss is the chosen sequences' language-modelling loss (their NLL) plus
``beta`` times the log-sigmoid of the log odds ratio between the chosen and the rejected completions, on length-
averaged log-probabilities. Names and meanings are TRL's ``ORPOTrainer``/``ORPOConfig`` (``trl.experimental``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardkit.preference._family_config import check_positive, refuse_unless_default
from shardkit.trainer.arguments import TrainingArguments

__all__ = ["ORPOConfig", "log1mexp", "odds_ratio_loss"]

_MINUS_LN2 = -0.6931471805599453


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, without cancellation: ``log1p(-exp(x))`` below ``-ln 2``, else
    ``log(-expm1(x))`` (Maechler's split)."""
    return torch.where(x < _MINUS_LN2, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, *, beta: float = 0.1,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term per pair.

    Args:
        chosen_logps, rejected_logps: ``[pairs]`` mean per-token log-probs of the completions (length-averaged:
            the odds are of the average token, as in the paper).
        beta: the weight of the odds-ratio term (the paper's lambda).

    Returns:
        ``(losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen)``, each ``[pairs]``:
        ``losses`` is ``-beta * log sigmoid(log odds ratio)`` (the trainer adds its mean to the chosen NLL); the
        rewards are ``beta * logps`` (detached); ``log_odds_ratio`` is ``log sigmoid(log odds)`` and
        ``log_odds_chosen`` the log odds (detached; TRL logs their means under these names).
    """
    chosen_logps, rejected_logps = chosen_logps.float(), rejected_logps.float()
    log_odds = (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))
    ratio = F.logsigmoid(log_odds)
    losses = -(beta * ratio)
    return (losses, beta * chosen_logps.detach(), beta * rejected_logps.detach(), ratio.detach(), log_odds.detach())


@dataclass
class ORPOConfig(TrainingArguments):
    """Settings of an :class:`~shardkit.preference.ORPOTrainer` run: every TrainingArguments field plus TRL's ORPO
    ones.

        max_length: tokens kept per sequence (prompt + completion): the completion is cut to fit, the prompt never;
            a prompt that alone fills ``max_length`` is an error naming the row (TRL trains on an empty
            completion). None: 512, as TRL.
        beta: the weight of the odds-ratio term (the paper's lambda; default 0.1).
        disable_dropout: switch dropout off in the model (default True).
        padding_value: the token id that pads ``input_ids`` (default: the tokenizer's pad token).
        model_init_kwargs: keyword arguments of ``AutoModelForCausalLM.from_pretrained`` for a model given as a
            path (refused for a model already built).
        trust_remote_code: forwarded to ``from_pretrained``.
        dataset_num_proc: processes for ``datasets.Dataset.map`` when tokenizing.
        max_completion_length, is_encoder_decoder: encoder-decoder settings (not supported: decoder-only models).
        generate_during_eval: samples logged to W&B/Comet during evaluation (not supported: must stay False).
    """

    # Not settings (no annotation, so no dataclass field): what the shared PreferenceTrainer reads of DPO's data
    # options. These trainers cut and pad their rows as TRL's do (see max_length), never padding-free.
    truncation_mode = "keep_start"
    padding_free = False

    learning_rate: float = 1e-6  # TRL's default for ORPO
    max_length: int | None = 1024
    max_completion_length: int | None = None
    beta: float = 0.1
    disable_dropout: bool = True
    padding_value: int | None = None
    generate_during_eval: bool = False
    is_encoder_decoder: bool | None = None
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    dataset_num_proc: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "beta")
        check_decoder_only_settings(self)


def check_decoder_only_settings(config: Any) -> None:
    """The settings ORPOConfig and CPOConfig share: lengths, and what only encoder-decoder models or W&B use."""
    for name in ("max_length", "dataset_num_proc"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{type(config).__name__}.{name}={value!r} must be an integer >= 1 or None")
    if config.is_encoder_decoder is False:
        config.is_encoder_decoder = None  # what a decoder-only model is anyway
    refuse_unless_default(config, {
        "max_completion_length": "it applies to encoder-decoder models only (decoder-only completions are cut by "
                                 "max_length)",
        "is_encoder_decoder": "encoder-decoder models are not trained by this trainer (decoder-only causal LMs)",
        "generate_during_eval": "samples are not generated during evaluation",
    })
