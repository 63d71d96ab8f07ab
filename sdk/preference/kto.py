"""KTO's losses (Kahneman-Tversky Optimization, https://huggingface.co/papers/2402.01306) and its settings.

Pure functions of per-sequence log-probabilities: the trainer computes those (one chunked log-prob op, never the
``[tokens, vocab]`` logits) and hands them here. Names and meanings are TRL's ``KTOTrainer``/``KTOConfig``.

KTO learns from unpaired rows: a prompt, one completion and a label (desirable or not). Each completion's implied
reward ``beta * (log pi(y|x) - log pi_ref(y|x))`` is compared with a reference point, an estimate of the KL
divergence between the policy and the reference, taken on mismatched (prompt, completion) pairs of the same batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.preference._family_config import check_choice, check_positive, refuse_unless_default
from shardkit.trainer.arguments import TrainingArguments

__all__ = ["KTO_LOSS_TYPES", "KTOConfig", "kto_kl", "kto_loss"]

# "kto": Eq. (7) of the KTO paper; "apo_zero_unpaired": the unpaired APO-zero loss (https://huggingface.co/papers/
# 2408.06266), which needs no KL reference point.
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def uses_kl(loss_type: str) -> bool:
    """Whether the loss needs the KL reference point (and so mismatched completions in every batch)."""
    return loss_type != "apo_zero_unpaired"


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor,
           mean_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """KTO's reference point: the mean of ``log pi - log pi_ref`` over the batch's mismatched pairs, averaged over
    data-parallel ranks (``mean_over_ranks``), never below 0, and without gradient (a baseline, not a target).

    Args:
        kl_logps: ``[rows]`` summed completion log-probs of the policy on the mismatched pairs.
        ref_kl_logps: the same under the reference model.
        mean_over_ranks: averages a 0-d tensor over the data-parallel ranks; None on one rank.
    """
    kl = (kl_logps - ref_kl_logps).mean().detach()
    if mean_over_ranks is not None:
        kl = mean_over_ranks(kl)
    return kl.clamp(min=0)


def kto_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, kl: torch.Tensor, *, beta: float = 0.1, loss_type: str = "kto",
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row KTO losses and the rows' implied rewards.

    Args:
        chosen_logps, rejected_logps: ``[n_desirable]`` / ``[n_undesirable]`` summed completion log-probs of the
            policy on the desirable and the undesirable rows (either may be empty).
        ref_chosen_logps, ref_rejected_logps: the same under the reference model.
        kl: the reference point from :func:`kto_kl` (ignored by ``"apo_zero_unpaired"``).
        beta: the reward scale (higher: the policy stays closer to the reference).
        loss_type: one of :data:`KTO_LOSS_TYPES`.
        desirable_weight, undesirable_weight: each side's losses are multiplied by these (to balance unequal
            numbers of desirable and undesirable rows).

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``: ``losses`` is ``[n_desirable + n_undesirable]``, the
        desirable rows first; the trainer's loss is its mean. The rewards are detached.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"kto_loss: loss_type={loss_type!r} is not one of {list(KTO_LOSS_TYPES)}")
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))
        rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))
    else:  # apo_zero_unpaired: push desirable likelihoods up and undesirable ones down, no reference point
        chosen_losses = 1 - torch.sigmoid(beta * chosen_logratios)
        rejected_losses = torch.sigmoid(beta * rejected_logratios)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


@dataclass
class KTOConfig(TrainingArguments):
    """Settings of a :class:`~shardkit.preference.KTOTrainer` run: every TrainingArguments field plus TRL's KTO ones.

    Model:
        model_init_kwargs: keyword arguments of ``AutoModelForCausalLM.from_pretrained`` when the model is given
            as a path (refused for a model already built: they would do nothing).
        trust_remote_code: forwarded to ``from_pretrained`` for a model given as a path.
        router_aux_loss_coef: Mixture-of-Experts load-balancing loss weight (not added: None or 0.0).
        disable_dropout: switch dropout off in the model and the reference model (default True).

    Data:
        dataset_num_proc: processes for ``datasets.Dataset.map`` when tokenizing.
        max_length: tokens kept per sequence (prompt + completion, cut at the end); a prompt that alone fills
            ``max_length`` is an error naming the row (TRL drops such rows without a word). None: no limit.
        pad_to_multiple_of: round padded rows up to a multiple of this; ``"auto"`` means no rounding here (TRL
            rounds to 128 only on Neuron devices).
        precompute_ref_log_probs, precompute_ref_batch_size: TRL's reference log-probs computed before training
            (not supported: must stay False / None).

    Loss:
        loss_type: ``"kto"`` or ``"apo_zero_unpaired"``.
        beta: the reward scale (default 0.1).
        desirable_weight, undesirable_weight: weights of the desirable and undesirable rows' losses.
        activation_offloading: (not supported: must stay False).
        sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps: TR-DPO's reference model updates (not
            supported: sync_ref_model must stay False).

    ``train_sampling_strategy`` defaults to ``"sequential"`` as in TRL; here the KL pairs are built inside each
    micro-batch, so ``"random"`` keeps them right as well.
    """

    # Not settings (no annotation, so no dataclass field): what the shared PreferenceTrainer reads of DPO's data
    # options. These trainers cut and pad their rows as TRL's do (see max_length), never padding-free.
    truncation_mode = "keep_start"
    padding_free = False

    learning_rate: float = 1e-6  # TRL's default for KTO
    train_sampling_strategy: str = "sequential"
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    pad_to_multiple_of: int | str | None = "auto"
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    activation_offloading: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self, "loss_type", KTO_LOSS_TYPES)
        check_positive(self, "beta")
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"KTOConfig.{name}={getattr(self, name)} must be >= 0")
        if isinstance(self.pad_to_multiple_of, str):
            text = self.pad_to_multiple_of.strip().lower()
            self.pad_to_multiple_of = None if text in ("auto", "none", "null") else int(text)
        for name in ("max_length", "pad_to_multiple_of", "dataset_num_proc"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"KTOConfig.{name}={value!r} must be an integer >= 1 or None")
        if self.router_aux_loss_coef not in (None, 0.0):
            raise ValueError(f"KTOConfig.router_aux_loss_coef={self.router_aux_loss_coef!r} is not supported: "
                             "Mixture-of-Experts auxiliary losses are not added by shardkit's KTOTrainer. Set 0.0 "
                             "(train an MoE model without it) or leave it at None (a dense model)")
        refuse_unless_default(self, {
            "precompute_ref_log_probs": "the reference log-probs are computed on the fly, on the same chunked op",
            "precompute_ref_batch_size": "it applies only with precompute_ref_log_probs",
            "activation_offloading": "use gradient_checkpointing (or the strategy's offloading) instead",
            "sync_ref_model": "TR-DPO reference updates are not implemented for KTO",
        })
