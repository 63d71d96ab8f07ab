"""What KTO, ORPO and CPO add to :class:`~shardkit.preference.base.PreferenceTrainer`: their own rows and
collators (TRL tokenizes them differently from DPO's), prepared before the shared base sets the trainer up.

The base tokenizes prompt/chosen/rejected rows the way DPO does; the family's rows (KTO's unpaired ones, ORPO's and
CPO's pairs with TRL's older tokenization) are prepared here by :meth:`FamilyTrainer.prepare_dataset` and batched
by :meth:`FamilyTrainer.default_collator`; everything else (the model, the reference, the forward, the loss
normalised over the whole optimizer step, the metrics) is the base's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from shardkit.preference.base import PreferenceTrainer
from shardkit.preference.token_scores import check_no_softcap

__all__ = ["FamilyTrainer"]


def _tokenizer_for(tokenizer: Any, model: Any, trainer: str) -> Any:
    if tokenizer is None:
        path = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        if not path:
            raise ValueError(f"{trainer} needs a tokenizer: pass processing_class=tokenizer (nothing is downloaded)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is never scored
    return tokenizer


class FamilyTrainer(PreferenceTrainer):
    """The base of KTOTrainer, ORPOTrainer and CPOTrainer (see the module docstring).

    A subclass sets ``config_class`` and implements :meth:`prepare_dataset`, :meth:`default_collator`,
    :meth:`~shardkit.preference.base.PreferenceTrainer.preference_loss` and
    :meth:`~shardkit.preference.base.PreferenceTrainer.count_items`.
    """

    config_class: type = type(None)

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: Any = None, optimizers: tuple = (None, None),
                 peft_config: Any = None, *, strategy: Any = None, precision: Any = None):
        name = type(self).__name__
        config = self.config_class
        if args is None:
            args = config(output_dir=f"{name.removesuffix('Trainer').lower()}_output")
        if not isinstance(args, config):
            raise TypeError(f"{name} takes a {config.__name__} as args, got {type(args).__name__}: "
                            f"{config.__name__}(**your_training_arguments_fields, beta=...)")
        if train_dataset is None:
            raise ValueError(f"{name} needs a train_dataset")
        if args.model_init_kwargs is not None and not isinstance(model, str):
            raise ValueError(f"{config.__name__}.model_init_kwargs is set but the model is already built, so they "
                             "would do nothing: pass the model's path, or leave model_init_kwargs unset")
        if args.trust_remote_code and isinstance(model, str):
            kwargs = args.model_init_kwargs if isinstance(args.model_init_kwargs, Mapping) else {}
            args.model_init_kwargs = {**kwargs, "trust_remote_code": True}
        if not isinstance(model, str):
            check_no_softcap(model, name)
        tokenizer = _tokenizer_for(processing_class, model, name)
        self._prepared_train = self.prepare_dataset(train_dataset, tokenizer, args, "train")
        if isinstance(eval_dataset, Mapping):
            prepared_eval: Any = {k: self.prepare_dataset(v, tokenizer, args, k) for k, v in eval_dataset.items()}
        else:
            prepared_eval = None if eval_dataset is None else self.prepare_dataset(eval_dataset, tokenizer, args,
                                                                                    "eval")
        if data_collator is None:
            data_collator = self.default_collator(tokenizer, args)
        # The base tokenizes DPO's rows: it gets none, and the family's prepared ones are put in place after.
        super().__init__(model, ref_model, args, data_collator, None, None, tokenizer, compute_metrics, callbacks,
                         optimizers, peft_config, strategy=strategy, precision=precision)
        if isinstance(model, str):
            check_no_softcap(self.model, name)
        self.train_dataset, self.eval_dataset = self._prepared_train, prepared_eval

    def estimate_run_steps(self, args: Any, train_dataset: Any) -> tuple[int | None, int | None]:
        # The base was handed no rows (it would tokenize DPO's): the family's prepared ones are those trained on.
        return super().estimate_run_steps(args, self._prepared_train)

    def prepare_dataset(self, dataset: Any, tokenizer: Any, args: Any, name: str) -> Any:
        """Rows in, tokenized rows out (errors name the row and the field)."""
        raise NotImplementedError

    def default_collator(self, tokenizer: Any, args: Any) -> Any:
        """The collator batches are built with when none is given."""
        raise NotImplementedError

    def mean_over_ranks(self, value: Any) -> Any:
        """A 0-d tensor averaged over the data-parallel ranks (itself on one rank)."""
        if self.runner.world_size == 1:
            return value
        # Ranks that share a batch (tensor/context parallel) hold the same value: the mean over all ranks is the
        # mean over the data-parallel ones.
        return self.runner.all_reduce(value.clone(), "sum") / self.runner.world_size
