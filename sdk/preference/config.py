"""DPOConfig: TrainingArguments plus TRL 1.x's DPO settings, under TRL's names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shardkit.preference.data import TRUNCATION_MODES
from shardkit.preference.losses import DPO_LOSS_TYPES
from shardkit.trainer.arguments import TrainingArguments
from shardkit.utils.suggest import did_you_mean

__all__ = ["DPOConfig", "refuse_unsupported"]


def refuse_unsupported(config: Any, unsupported: dict[str, tuple[Any, str]]) -> None:
    """Fail on a TRL field set to anything but its default that shardkit does not implement (never ignored)."""
    name = type(config).__name__
    for key, (default, why) in unsupported.items():
        value = getattr(config, key)
        if value != default:
            raise NotImplementedError(f"{name}.{key}={value!r} is not supported by shardkit: {why}. Leave it at "
                                      f"{default!r}")


def check_length(config: Any, name: str) -> None:
    value = getattr(config, name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{type(config).__name__}.{name}={value!r} must be an integer >= 1 or None")


@dataclass
class DPOConfig(TrainingArguments):
    """Settings of a :class:`~shardkit.preference.DPOTrainer` run: TrainingArguments plus TRL's DPO fields.

    Model: ``model_init_kwargs`` (for a model given by path), ``disable_dropout`` (policy and reference).
    Data: ``max_length`` (prompt + completion tokens per sequence), ``truncation_mode`` (``"keep_start"`` or
    ``"keep_end"``), ``padding_free`` (chosen and rejected packed into one row without padding, through
    shardkit's varlen attention), ``pad_to_multiple_of``, ``dataset_num_proc``, ``pad_token``.
    Reference: ``precompute_ref_log_probs`` (+ ``precompute_ref_batch_size``), ``sync_ref_model`` with
    ``ref_model_mixup_alpha`` and ``ref_model_sync_steps`` (TR-DPO).
    Loss: ``beta``, ``loss_type`` (one name or a list, see :data:`shardkit.preference.losses.DPO_LOSS_TYPES`) with
    ``loss_weights``, ``label_smoothing`` (robust, exo_pair, aot), ``use_weighting`` (WPO), ``ld_alpha`` (LD-DPO),
    ``discopop_tau``.

    TRL fields shardkit does not implement (``f_divergence_type``, ``router_aux_loss_coef``,
    ``activation_offloading``, ``trust_remote_code``) fail when set to anything but their default.
    """

    learning_rate: float = 1e-6  # TRL's default for DPO
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    disable_dropout: bool = True
    dataset_num_proc: int | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    padding_free: bool = False
    pad_to_multiple_of: int | None = None
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    loss_weights: list[float] | None = None
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    label_smoothing: float = 0.0
    beta: float = 0.1
    use_weighting: bool = False
    discopop_tau: float = 0.05
    activation_offloading: bool = False
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    pad_token: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_unsupported(self, {
            "f_divergence_type": ("reverse_kl", "the f-DPO divergences are not implemented"),
            "activation_offloading": (False, "activation offloading is not implemented; use gradient_checkpointing"),
            "trust_remote_code": (False, "models are not loaded with remote code; load it yourself and pass the model"),
        })
        if self.router_aux_loss_coef not in (None, 0.0):
            raise NotImplementedError(f"{type(self).__name__}.router_aux_loss_coef={self.router_aux_loss_coef!r} is "
                                      "not supported by shardkit: Mixture-of-Experts auxiliary losses are not added. "
                                      "Set 0.0 (train an MoE model without it) or leave it at None (a dense model)")
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        if not self.loss_type:
            raise ValueError("DPOConfig.loss_type is empty: name at least one loss (default 'sigmoid')")
        for name in self.loss_type:
            if name not in DPO_LOSS_TYPES:
                raise ValueError(f"DPOConfig.loss_type: {name!r} is not one of {list(DPO_LOSS_TYPES)}"
                                 f"{did_you_mean(str(name), DPO_LOSS_TYPES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"DPOConfig.loss_weights has {len(self.loss_weights)} weights for "
                             f"{len(self.loss_type)} loss types: give one weight per loss_type")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"DPOConfig.beta={self.beta} must be a positive number")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"DPOConfig.truncation_mode={self.truncation_mode!r} is not one of "
                             f"{list(TRUNCATION_MODES)}{did_you_mean(str(self.truncation_mode), TRUNCATION_MODES)}")
        for name in ("max_length", "pad_to_multiple_of", "dataset_num_proc", "precompute_ref_batch_size"):
            check_length(self, name)
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"DPOConfig.ld_alpha={self.ld_alpha} must lie in [0, 1] (or None)")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0.0:
            raise ValueError("DPOConfig: loss_type 'exo_pair' needs label_smoothing > 0 (EXO's epsilon; the paper "
                             "suggests 1e-3)")
        if "robust" in self.loss_type and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"DPOConfig: loss_type 'robust' needs label_smoothing in [0, 0.5), got "
                             f"{self.label_smoothing}")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(self.loss_type):
            raise ValueError("DPOConfig: use_weighting (WPO) does not combine with 'aot'/'aot_unpaired', which sort "
                             "the pairs and so misalign their weights")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError("DPOConfig: sync_ref_model=True updates the reference during training, so "
                             "precompute_ref_log_probs=True would read stale values; set one of them False")
        if self.sync_ref_model and (not 0.0 <= self.ref_model_mixup_alpha <= 1.0 or self.ref_model_sync_steps < 1):
            raise ValueError("DPOConfig: ref_model_mixup_alpha must lie in [0, 1] and ref_model_sync_steps be >= 1")

    @property
    def weights(self) -> list[float]:
        """One weight per ``loss_type`` (``loss_weights``, default 1.0 each)."""
        return list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(self.loss_type)
