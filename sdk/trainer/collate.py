"""Batches for the Trainer: Hugging Face's default collation, and dropping the columns the model's forward does not
take (``remove_unused_columns``).

Without ``data_collator=``, samples are collated as transformers' ``default_data_collator`` does: each field
becomes one tensor (a tokenized ``datasets`` split's lists of ids become a ``(batch, length)`` tensor, not
torch's transposed lists), ``label``/``label_ids`` become ``labels``, strings are left out. With a tokenizer as
``processing_class`` the batch is padded by it (``DataCollatorWithPadding``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["ColumnFilter", "check_columns", "default_collator", "default_data_collator", "loader_kwargs"]

logger = logging.getLogger("shardkit.trainer")


def _stack(values: list[Any], dtype: torch.dtype | None = None) -> torch.Tensor:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(values))
    try:
        return torch.tensor(values, dtype=dtype)
    except (ValueError, TypeError) as err:
        raise ValueError(f"cannot make one tensor of this field ({err}): its samples differ in length. Pass "
                         "processing_class=<tokenizer> (pads the batch) or a data_collator that pads") from None


def default_data_collator(features: list[Any]) -> dict[str, Any]:
    """Hugging Face's ``default_data_collator``: one tensor per field; ``label``/``label_ids`` -> ``labels``."""
    if not isinstance(features[0], Mapping):
        features = [vars(f) for f in features]
    first = features[0]
    batch: dict[str, Any] = {}
    for name in ("label", "label_ids"):
        value = first.get(name)
        if value is None:
            continue
        probe = value.item() if isinstance(value, torch.Tensor) and value.ndim == 0 else value
        if isinstance(probe, (list, tuple)) and probe:
            probe = probe[0]
        integer = isinstance(probe, (int, np.integer)) and not isinstance(probe, bool)
        batch["labels"] = _stack([f[name] for f in features], None if isinstance(value, (torch.Tensor, np.ndarray))
                                 else torch.long if integer else torch.float)
        break
    for key, value in first.items():
        if key not in ("label", "label_ids") and value is not None and not isinstance(value, str):
            batch[key] = _stack([f[key] for f in features])
    return batch


def default_collator(processing_class: Any = None):
    """Pad with the tokenizer when one is given (HF's DataCollatorWithPadding), else :func:`default_data_collator`."""
    if processing_class is not None and callable(getattr(processing_class, "pad", None)):
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def _forward_columns(model: Any) -> tuple[set[str], bool]:
    """(the names forward takes, whether it takes only ``*args``/``**kwargs``). As Hugging Face does, a column
    reaches ``**kwargs`` only when forward names no parameter at all (a wrapper that passes everything on)."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return set(), True
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    named = {n for n, p in params.items() if p.kind not in variadic and n != "self"}
    return named, not named


def _no_columns_error(model_name: str, columns: set[str], ignored: list[str]) -> ValueError:
    return ValueError(f"No columns in the dataset match the model's forward method signature: "
                      f"({', '.join(sorted(columns))}). The following columns have been ignored: "
                      f"[{', '.join(ignored)}]. Please check the dataset and model ({model_name}: tokenize the text "
                      "into input_ids first). You may need to set `remove_unused_columns=False` in "
                      "`TrainingArguments`.")


def check_columns(dataset: Any, model: Any, label_names: list[str]) -> None:
    """A ``datasets`` split none of whose columns the model's forward takes is refused before training starts
    (with Hugging Face's message), instead of failing inside the model."""
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, list) or not names:
        return
    allowed, takes_all = _forward_columns(model)
    allowed |= set(label_names) | {"label", "label_ids"}
    if not takes_all and not any(n in allowed for n in names):
        raise _no_columns_error(type(model).__name__, allowed, names)


class ColumnFilter:
    """Wraps a collator: renames ``label`` to ``labels`` (as HF's collators do) and drops sample keys the
    model's forward does not take, warning once with their names. Picklable for worker processes."""

    def __init__(self, collator, model, label_names: list[str]):
        self.collator = collator
        allowed, self.keep_all = _forward_columns(model)
        self.allowed = allowed | set(label_names) | {"label", "label_ids"}
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
        if dropped and len(dropped) == len(sample):
            raise _no_columns_error(self.model_name, self.allowed, dropped)
        if dropped and not self.warned:
            self.warned = True
            logger.warning(f"remove_unused_columns: dropping {dropped}, which {self.model_name}.forward does not "
                           "take (set remove_unused_columns=False to keep them)")
        return {k: v for k, v in sample.items() if k in self.allowed}


def loader_kwargs(args: Any) -> dict[str, Any]:
    """The DataLoader keywords TrainingArguments set: workers, pinning, and the worker options when there are."""
    kwargs: dict[str, Any] = {"num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory}
    if args.dataloader_num_workers > 0:
        kwargs.update(persistent_workers=args.dataloader_persistent_workers)
        if args.dataloader_prefetch_factor is not None:
            kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
        if args.dataloader_multiprocessing_context is not None:
            kwargs["multiprocessing_context"] = args.dataloader_multiprocessing_context
    return kwargs
