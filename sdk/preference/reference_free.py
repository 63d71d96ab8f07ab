"""ORPOTrainer and CPOTrainer (SimPO included): the reference-free preference trainers (TRL's
``trl.experimental`` ``ORPOTrainer``/``CPOTrainer`` APIs) on the shared preference base.

    trainer = CPOTrainer(model, args=CPOConfig(output_dir="out", loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5),
                         train_dataset=pairs, processing_class=tokenizer)
    trainer.train()

Chosen and rejected go through one forward, its positions scored by the chunked log-prob op (the logits never
exist); there is no reference model. Rows are tokenized as TRL tokenizes them for these trainers
(:mod:`shardkit.preference.pair_tokens`). The loss terms are normalised over the whole optimizer step (pairs, and
tokens for the NLL), which is TRL's per-micro-batch mean when a step is one micro-batch on one rank.

Logged under TRL's names: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected`` (the mean logit over the vocabulary
and over the rows' positions, padding included, as TRL averages its logits tensor: all positions but the last for
ORPO, all for CPO), ``nll_loss``; ORPO adds ``log_odds_ratio`` and ``log_odds_chosen``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from shardkit.preference.cpo import CPOConfig, averages_logps, cpo_loss
from shardkit.preference.family_base import FamilyTrainer
from shardkit.preference.orpo import ORPOConfig, odds_ratio_loss
from shardkit.preference.pair_tokens import DataCollatorForPairs, prepare_pair_dataset
from shardkit.preference.token_scores import TokenScores, mean_logits, score_tokens

__all__ = ["CPOTrainer", "ORPOTrainer"]

_TRL_DEFAULT_LENGTH = 512  # TRL's length when max_length is None


class _ReferenceFree(FamilyTrainer):
    """The pair data, the one forward and the metrics ORPO and CPO share."""

    uses_reference = False
    trainer_name = ""
    # Whether TRL's logits/* metrics average the mean logit at the last position too: ORPO drops it, CPO keeps it.
    logits_at_last = True

    # TRL's positional order, model_init and preprocess_logits_for_metrics included.
    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, model_init: Any = None,
                 callbacks: Any = None, optimizers: tuple = (None, None), preprocess_logits_for_metrics: Any = None,
                 peft_config: Any = None, compute_metrics: Any = None, *, strategy: Any = None,
                 precision: Any = None):
        name = type(self).__name__
        if model_init is not None:
            raise NotImplementedError(f"{name}(model_init=...) is not supported: build the model and pass it as model")
        if preprocess_logits_for_metrics is not None:
            raise NotImplementedError(f"{name}(preprocess_logits_for_metrics=...) is not supported: the logits are "
                                      "never built (the log-probs come from the chunked op)")
        super().__init__(model, None, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_metrics, callbacks, optimizers, peft_config, strategy=strategy, precision=precision)

    def prepare_dataset(self, dataset: Any, tokenizer: Any, args: Any, name: str) -> Any:
        length = args.max_length if args.max_length is not None else _TRL_DEFAULT_LENGTH
        return prepare_pair_dataset(dataset, tokenizer, length, self.trainer_name, args.dataset_num_proc, name)

    def default_collator(self, tokenizer: Any, args: Any) -> DataCollatorForPairs:
        return DataCollatorForPairs(tokenizer.pad_token_id, getattr(args, "padding_value", None))

    def count_items(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """Pairs; the chosen rows' completion tokens; the chosen rows' tokens (prompt included) after the first."""
        half = batch["input_ids"].shape[0] // 2
        return {"pairs": float(half), "chosen_tokens": float(batch["completion_mask"][:half, 1:].sum()),
                "chosen_sequence_tokens": float(batch["attention_mask"][:half, 1:].sum())}

    def _forward(self, model: nn.Module, inputs: dict[str, Tensor], mask: Tensor) -> TokenScores:
        return score_tokens(model, self.runner.unwrap_model(model), inputs, mask)

    def _metrics_of(self, scores: TokenScores, chosen_logps: Tensor, rejected_logps: Tensor,
                    chosen_rewards: Tensor, rejected_rewards: Tensor, nll: Tensor, nll_tokens: float
                    ) -> dict[str, tuple[Tensor, float]]:
        half = chosen_logps.shape[0]
        pairs = float(half)
        hidden = scores.with_last(f"{self.trainer_name}Trainer") if self.logits_at_last else scores.hidden
        logits = mean_logits(hidden, self.runner.unwrap_model(self.model))
        per_side = float(logits[:half].numel())
        return {
            "rewards/chosen": (chosen_rewards.sum(), pairs),
            "rewards/rejected": (rejected_rewards.sum(), pairs),
            "rewards/accuracies": ((chosen_rewards > rejected_rewards).float().sum(), pairs),
            "rewards/margins": ((chosen_rewards - rejected_rewards).sum(), pairs),
            "logps/chosen": (chosen_logps.detach().sum(), pairs),
            "logps/rejected": (rejected_logps.detach().sum(), pairs),
            "logits/chosen": (logits[:half].sum(), per_side),
            "logits/rejected": (logits[half:].sum(), per_side),
            "nll_loss": (nll.detach(), nll_tokens),
        }


class ORPOTrainer(_ReferenceFree):
    """ORPO with TRL's names (see :class:`~shardkit.preference.ORPOConfig`): no reference model; the loss is the
    chosen sequences' NLL (prompt and completion tokens, as TRL) plus the mean odds-ratio term.

    Args:
        model: a torch module, a Hugging Face causal LM, a PeftModel, or a model path.
        args: an :class:`ORPOConfig`.
        train_dataset, eval_dataset: prompt/chosen/rejected rows (text or conversations), a ``datasets.Dataset``
            or a list of dicts.
        processing_class: the tokenizer.
        peft_config: a ``peft`` config; the model is wrapped with ``get_peft_model``.
        Other arguments: as :class:`shardkit.trainer.Trainer`.
    """

    config_class = ORPOConfig
    trainer_name = "ORPO"
    logits_at_last = False

    def preference_loss(self, model: nn.Module, inputs: dict[str, Tensor]
                        ) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, float]]]:
        half = inputs["input_ids"].shape[0] // 2
        attended = inputs["attention_mask"][:, 1:].bool()
        completion = inputs["completion_mask"][:, 1:].bool()
        scores = self._forward(model, inputs, attended | completion)
        means = scores.sums(completion) / completion.sum(1).clamp(min=1)
        nll = -scores.logps[:half].sum()
        losses, chosen_rewards, rejected_rewards, ratio, log_odds = odds_ratio_loss(means[:half], means[half:],
                                                                                   beta=self.args.beta)
        metrics = self._metrics_of(scores, means[:half], means[half:], chosen_rewards, rejected_rewards, nll,
                                   float(attended[:half].sum()))
        metrics["log_odds_ratio"] = (ratio.sum(), float(half))
        metrics["log_odds_chosen"] = (log_odds.sum(), float(half))
        return {"chosen_sequence_tokens": nll, "pairs": losses.sum()}, metrics


class CPOTrainer(_ReferenceFree):
    """CPO, SimPO and AlphaPO with TRL's names (see :class:`~shardkit.preference.CPOConfig`): no reference model;
    the loss is the mean pair loss plus ``cpo_alpha`` times the chosen completions' NLL.

    Args: as :class:`ORPOTrainer`, with a :class:`CPOConfig`.
    """

    config_class = CPOConfig
    trainer_name = "CPO"

    def preference_loss(self, model: nn.Module, inputs: dict[str, Tensor]
                        ) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, float]]]:
        args = self.args
        half = inputs["input_ids"].shape[0] // 2
        completion = inputs["completion_mask"][:, 1:].bool()
        scores = self._forward(model, inputs, completion)
        logps = scores.sums()
        if averages_logps(args.loss_type):
            logps = logps / completion.sum(1).clamp(min=1)
        losses, chosen_rewards, rejected_rewards = cpo_loss(
            logps[:half], logps[half:], beta=args.beta, loss_type=args.loss_type,
            label_smoothing=args.label_smoothing, simpo_gamma=args.simpo_gamma, alpha=args.alpha)
        terms = {"pairs": losses.sum()}
        chosen_tokens = float(completion[:half].sum())
        if args.cpo_alpha != 0:
            nll = -scores.logps[:half].sum()
            terms["chosen_tokens"] = args.cpo_alpha * nll
        else:  # TRL logs a zero NLL when the behaviour-cloning term is off
            nll, chosen_tokens = torch.zeros((), device=logps.device), 1.0
        metrics = self._metrics_of(scores, logps[:half], logps[half:], chosen_rewards, rejected_rewards, nll,
                                   chosen_tokens)
        return terms, metrics
