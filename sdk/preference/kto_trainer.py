"""KTOTrainer: Kahneman-Tversky Optimization (TRL's ``KTOTrainer`` API) on the shared preference base.

    trainer = KTOTrainer(model, args=KTOConfig(output_dir="out", beta=0.1, desirable_weight=1.0),
                         train_dataset=rows, processing_class=tokenizer)   # rows: prompt/completion/label
    trainer.train()

Per micro-batch, as TRL: the policy scores the batch's completions (one forward, chunked log-prob op) and, without
gradient, the mismatched pairs the collator built (each prompt with the previous row's completion); the reference
scores both; the KL reference point is the mean policy-minus-reference log-ratio of the mismatched pairs over the
data-parallel ranks, clamped at 0. The loss is the mean of the rows' weighted losses over the whole optimizer step.

Logged under TRL's names: ``kl``, ``entropy`` (completion tokens), ``num_tokens`` (tokens trained on so far),
``logits/chosen``, ``logits/rejected`` (mean logit over the vocabulary, averaged over completion tokens),
``rewards/chosen``, ``logps/chosen``, ``rewards/rejected``, ``logps/rejected``, ``rewards/margins``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from shardkit.preference.family_base import FamilyTrainer
from shardkit.preference.kto import KTOConfig, kto_kl, kto_loss, uses_kl
from shardkit.preference.kto_data import DataCollatorForUnpairedPreference, prepare_unpaired_dataset
from shardkit.preference.token_scores import mean_logits, score_tokens

__all__ = ["KTOTrainer"]

logger = logging.getLogger("shardkit.preference")

_KL_KEYS = ("input_ids", "attention_mask", "completion_mask")


def _warn_weights(dataset: Any, args: KTOConfig) -> None:
    """TRL's advice when desirable and undesirable rows are unbalanced (Eq. (8) of the KTO paper)."""
    labels = [bool(x) for x in dataset["label"]] if hasattr(dataset, "column_names") else \
        [bool(r["label"]) for r in dataset]
    desirable = max(sum(labels), 1)
    undesirable = max(len(labels) - desirable, 1)
    if desirable == undesirable:
        return
    low_d = round(undesirable * args.undesirable_weight / desirable, 2)
    high_d = round(undesirable * args.undesirable_weight / desirable * 1.33, 2)
    low_u = round(desirable * args.desirable_weight / undesirable / 1.33, 2)
    high_u = round(desirable * args.desirable_weight / undesirable, 2)
    if not (low_d <= args.desirable_weight <= high_d or low_u <= args.undesirable_weight <= high_u):
        logger.warning("KTO: %d desirable and %d undesirable rows, and the weights do not balance them: set "
                       "desirable_weight in [%s, %s] or undesirable_weight in [%s, %s] (not both)", desirable,
                       undesirable, low_d, high_d, low_u, high_u)


class KTOTrainer(FamilyTrainer):
    """KTO with TRL's names (see :class:`~shardkit.preference.KTOConfig`).

    Args:
        model: a torch module, a Hugging Face causal LM, a PeftModel, or a model path.
        ref_model: the frozen reference (default: a copy of ``model`` set up under the same strategy; none for a
            PEFT model, whose base with the adapter disabled is the reference).
        args: a :class:`KTOConfig`.
        train_dataset, eval_dataset: unpaired rows (``prompt``, ``completion``, ``label``) or paired ones
            (``prompt``/``chosen``/``rejected``, unpaired as TRL does), text or conversations; a
            ``datasets.Dataset`` or a list of dicts.
        processing_class: the tokenizer.
        quantization_config: a ``BitsAndBytesConfig`` for a model given as a path (QLoRA with ``peft_config``).
        peft_config: a ``peft`` config; the model is wrapped with ``get_peft_model``.
        Other arguments: as :class:`shardkit.trainer.Trainer`.
    """

    running_total_metrics = ("num_tokens",)

    config_class = KTOConfig

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: KTOConfig | None = None,
                 data_collator: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, compute_metrics: Any = None, callbacks: Any = None,
                 optimizers: tuple = (None, None), quantization_config: Any = None, peft_config: Any = None, *,
                 strategy: Any = None, precision: Any = None):
        if quantization_config is not None:
            if not isinstance(model, str):
                raise ValueError("KTOTrainer got quantization_config for a model already built: quantization applies "
                                 "when the model is loaded; pass the model's path, or omit quantization_config")
            if args is None:
                args = KTOConfig(output_dir="kto_output")
            kwargs = dict(args.model_init_kwargs or {}) if not isinstance(args.model_init_kwargs, str) else {}
            if "quantization_config" in kwargs:
                raise ValueError("quantization_config is given both to KTOTrainer and in KTOConfig.model_init_kwargs: "
                                 "give it once")
            args.model_init_kwargs = {**kwargs, "quantization_config": quantization_config}
        if args is not None and isinstance(args, KTOConfig) and uses_kl(args.loss_type) and \
                args.per_device_train_batch_size < 2:
            raise ValueError(f"KTOConfig.per_device_train_batch_size={args.per_device_train_batch_size}: loss_type="
                             f"{args.loss_type!r} estimates the KL term from mismatched pairs within a batch, so a "
                             "batch needs at least 2 rows (with 1 the KL term equals the row's own reward)")
        super().__init__(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_metrics, callbacks, optimizers, peft_config, strategy=strategy, precision=precision)
        _warn_weights(self.train_dataset, self.args)

    def prepare_dataset(self, dataset: Any, tokenizer: Any, args: Any, name: str) -> Any:
        return prepare_unpaired_dataset(dataset, tokenizer, args.max_length, args.dataset_num_proc, name)

    def default_collator(self, tokenizer: Any, args: Any) -> DataCollatorForUnpairedPreference:
        return DataCollatorForUnpairedPreference(tokenizer.pad_token_id, args.max_length, args.pad_to_multiple_of,
                                                 kl=uses_kl(args.loss_type))

    def count_items(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """The loss is the mean over the step's rows."""
        return {"rows": float(batch["input_ids"].shape[0]), "pairs": float(batch["input_ids"].shape[0])}

    def preference_loss(self, model: nn.Module, inputs: dict[str, Tensor]
                        ) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, float]]]:
        args = self.args
        rows = inputs["input_ids"].shape[0]
        unwrapped = self.runner.unwrap_model(model)
        scores = score_tokens(model, unwrapped, inputs, inputs["completion_mask"][:, 1:], entropy=True)
        logps = scores.sums_token_by_token()
        reference = self.reference_logps(model, inputs, rows)
        kl = torch.zeros((), device=logps.device)
        if uses_kl(args.loss_type):
            mismatched = {k: inputs[f"KL_{k}"] for k in _KL_KEYS}
            with torch.no_grad():
                kl_logps = self.concatenated_forward(model, mismatched, mean_logits=False).logps
            kl = kto_kl(kl_logps, self.reference_logps(model, mismatched, rows), self.mean_over_ranks)
        desirable = inputs["label"].bool()
        losses, chosen_rewards, rejected_rewards = kto_loss(
            logps[desirable], logps[~desirable], reference[desirable], reference[~desirable], kl, beta=args.beta,
            loss_type=args.loss_type, desirable_weight=args.desirable_weight,
            undesirable_weight=args.undesirable_weight)
        metrics = self._metrics_of(inputs, scores, logps.detach(), desirable, chosen_rewards, rejected_rewards, kl)
        return {"rows": losses.nansum()}, metrics

    def _metrics_of(self, inputs: dict[str, Tensor], scores: Any, logps: Tensor, desirable: Tensor,
                    chosen_rewards: Tensor, rejected_rewards: Tensor, kl: Tensor) -> dict[str, tuple[Tensor, float]]:
        mask = scores.mask
        per_row_logits = (mean_logits(scores.hidden, self.runner.unwrap_model(self.model)) * mask).sum(1)
        tokens = mask.sum(1).float()
        chosen, rejected = float(desirable.sum()), float((~desirable).sum())
        metrics: dict[str, tuple[Tensor, float]] = {
            "kl": (kl.detach(), 1.0),
            "entropy": (scores.entropy.sum(), float(tokens.sum())),
            "logits/chosen": (per_row_logits[desirable].sum(), float(tokens[desirable].sum())),
            "logits/rejected": (per_row_logits[~desirable].sum(), float(tokens[~desirable].sum())),
            "rewards/chosen": (chosen_rewards.nansum(), chosen),
            "logps/chosen": (logps[desirable].nansum(), chosen),
            "rewards/rejected": (rejected_rewards.nansum(), rejected),
            "logps/rejected": (logps[~desirable].nansum(), rejected),
        }
        # TRL's margin is the difference of the two means over all ranks, logged only when both sides have rows.
        sides = torch.stack([chosen_rewards.nansum(), torch.tensor(chosen, device=kl.device),
                             rejected_rewards.nansum(), torch.tensor(rejected, device=kl.device)]).double()
        if self.runner.world_size > 1:
            sides = self.runner.all_reduce(sides, "sum")
        if sides[1] > 0 and sides[3] > 0:
            metrics["rewards/margins"] = (sides[0] / sides[1] - sides[2] / sides[3], 1.0)
        if self.model.training:  # a running total (running_total_metrics), summed over ranks with the rest
            metrics["num_tokens"] = (inputs["attention_mask"].sum(), 0.0)
        return metrics
