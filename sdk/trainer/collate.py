"""Batches for the Trainer: default collation, and dropping the columns the model's forward does not take."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from torch.utils.data import default_collate

__all__ = ["ColumnFilter", "default_collator"]

logger = logging.getLogger("shardkit.trainer")


def default_collator(processing_class: Any = None):
    """Pad with the tokenizer when one is given (HF's DataCollatorWithPadding), else torch's default_collate."""
    if processing_class is not None and callable(getattr(processing_class, "pad", None)):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(processing_class)
    return default_collate


class ColumnFilter:
    """Wraps a collator: renames ``label`` to ``labels`` (as HF's collators do) and drops sample keys the
    model's forward does not take, warning once with their names. Picklable for worker processes."""

    def __init__(self, collator, model, label_names: list[str]):
        self.collator = collator
        params = inspect.signature(type(model).forward).parameters
        self.keep_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.allowed = set(params) | set(label_names) | {"label", "label_ids"}
        self.rename = "labels" in label_names
        self.model_name = type(model).__name__
        self.warned = False

    def __call__(self, samples: list[Any]) -> Any:
        if samples and isinstance(samples[0], Mapping):
            samples = [self._filter(s) for s in samples]
        return self.collator(samples)

    def _filter(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        sample = dict(sample)
        if self.rename and "labels" not in sample:
            for old in ("label", "label_ids"):
                if old in sample:
                    sample["labels"] = sample.pop(old)
                    break
        if self.keep_all:
            return sample
        dropped = sorted(k for k in sample if k not in self.allowed)
        if dropped and not self.warned:
            self.warned = True
            logger.warning("remove_unused_columns: dropping %s, which %s.forward does not take "
                           "(set remove_unused_columns=False to keep them)", dropped, self.model_name)
        return {k: v for k, v in sample.items() if k in self.allowed}
