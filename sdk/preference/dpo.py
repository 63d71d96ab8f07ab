"""DPOTrainer: Direct Preference Optimization (TRL 1.x's ``DPOTrainer`` API) on shardkit's Trainer.

    trainer = DPOTrainer(model, args=DPOConfig(output_dir="out", beta=0.1, loss_type=["sigmoid", "sft"],
                                               loss_weights=[1.0, 0.2]),
                         train_dataset=pairs, processing_class=tokenizer)
    trainer.train()

The losses are :mod:`shardkit.preference.losses`' pure functions; the forward, the reference and the exact
step-wide normalisation are :class:`~shardkit.preference.base.PreferenceTrainer`'s. Logged, as TRL:
``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected`` and ``logits/chosen``, ``logits/rejected`` (the mean logit over the vocabulary, averaged over
the completion tokens: computed from ``hidden . mean(W)``, never from the logits), ``entropy`` (of the next-token
distribution, averaged over the completion tokens; from the chunked op), ``mean_token_accuracy`` (the chosen
completion tokens that are their position's most likely token: the chosen rows' logits rebuilt a bounded block at
a time without gradient) and ``num_tokens`` (the tokens trained on so far, summed over the data-parallel ranks;
counted from this trainer's start, not kept in checkpoints, as TRL).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from shardkit.preference.base import PreferenceTrainer
from shardkit.preference.config import DPOConfig
from shardkit.preference.logps import SequenceLogps
from shardkit.preference.losses import PairLogps, dpo_rewards, pair_loss

__all__ = ["DPOTrainer"]


class DPOTrainer(PreferenceTrainer):
    """Direct Preference Optimization with TRL's names (see :class:`~shardkit.preference.DPOConfig`).

    Args:
        model: a torch module, a Hugging Face causal LM, a PeftModel, or a model path.
        ref_model: the frozen reference (default: a copy of ``model`` set up under the same strategy; none for a
            PEFT model, whose base with the adapter disabled is the reference).
        args: a :class:`DPOConfig`.
        train_dataset, eval_dataset: prompt/chosen/rejected rows (text or conversations), a ``datasets.Dataset``
            or a list of dicts.
        processing_class: the tokenizer.
        peft_config: a ``peft`` config; the model is wrapped with ``get_peft_model``.
        Other arguments: as :class:`shardkit.trainer.Trainer`.
    """

    running_total_metrics = ("num_tokens",)

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: DPOConfig | None = None,
                 data_collator: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, compute_metrics: Any = None, callbacks: Any = None,
                 optimizers: tuple = (None, None), peft_config: Any = None, *, strategy: Any = None,
                 precision: Any = None):
        if args is None:
            args = DPOConfig(output_dir="dpo_output")
        if not isinstance(args, DPOConfig):
            raise TypeError(f"DPOTrainer takes a DPOConfig as args, got {type(args).__name__}: "
                            "DPOConfig(**your_training_arguments_fields, beta=...)")
        if train_dataset is None:
            raise ValueError("DPOTrainer needs a train_dataset")
        if args.use_weighting and "sft" in args.loss_type:
            raise NotImplementedError("DPOConfig: use_weighting (WPO) with loss_type 'sft' is not supported: the "
                                      "SFT term is per token, WPO's weights per pair")
        super().__init__(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_metrics, callbacks, optimizers, peft_config, strategy=strategy, precision=precision)

    def preference_loss(self, model: nn.Module, inputs: dict[str, Tensor]
                        ) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, float]]]:
        args = self.args
        policy = self.concatenated_forward(model, inputs, ld_alpha=args.ld_alpha, wpo=args.use_weighting,
                                           token_stats=True)
        reference = self.reference_logps(model, inputs, policy.logps.shape[0])
        half = policy.logps.shape[0] // 2
        logps = PairLogps(policy.logps[:half], policy.logps[half:], reference[:half], reference[half:],
                          policy.tokens[:half], policy.tokens[half:])
        weights = None
        if args.use_weighting:
            wpo = torch.exp(policy.wpo_logps)
            weights = wpo[:half] * wpo[half:]
        by_pair = policy.logps.new_zeros(())
        terms: dict[str, Tensor] = {}
        for loss_type, weight in zip(args.loss_type, args.weights):
            if loss_type == "sft":
                nll = -policy.sum_logps[:half].sum() * weight
                terms["chosen_tokens"] = terms["chosen_tokens"] + nll if "chosen_tokens" in terms else nll
                continue
            losses = pair_loss(loss_type, logps, args.beta, args.label_smoothing, args.discopop_tau)
            if weights is not None:
                losses = losses * weights
            by_pair = by_pair + losses.sum() * weight
        if any(loss_type != "sft" for loss_type in args.loss_type):
            terms["pairs"] = by_pair
        metrics = self._metrics_of(logps, policy, half)
        if model.training:
            mask = inputs.get("attention_mask")
            metrics["num_tokens"] = (mask.sum() if mask is not None else inputs["input_ids"].numel(), 0.0)
        return terms, metrics

    def _metrics_of(self, logps: PairLogps, policy: SequenceLogps, half: int) -> dict[str, tuple[Tensor, float]]:
        chosen, rejected = dpo_rewards(logps, self.args.beta)
        mean_logits, tokens = policy.mean_logits, policy.tokens
        pairs = float(half)
        metrics = {
            "rewards/chosen": (chosen.sum(), pairs),
            "rewards/rejected": (rejected.sum(), pairs),
            "rewards/accuracies": ((chosen > rejected).float().sum(), pairs),
            "rewards/margins": ((chosen - rejected).sum(), pairs),
            "logps/chosen": (logps.chosen.detach().sum(), pairs),
            "logps/rejected": (logps.rejected.detach().sum(), pairs),
        }
        if mean_logits is not None:
            metrics["logits/chosen"] = (mean_logits[:half].sum(), float(tokens[:half].sum()))
            metrics["logits/rejected"] = (mean_logits[half:].sum(), float(tokens[half:].sum()))
        if policy.entropy is not None:
            metrics["entropy"] = (policy.entropy.sum(), float(tokens.sum()))
        if policy.top1 is not None:
            metrics["mean_token_accuracy"] = (policy.top1[:half].sum(), float(tokens[:half].sum()))
        return metrics
