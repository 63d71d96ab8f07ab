"""One optimizer step's micro-batches: the window's label count, each micro-batch's forward and backward, and the
loss it contributes (see ``shardkit.trainer.loss`` for why the loss is exact under accumulation and ranks).

Overridable as in Hugging Face's Trainer: ``training_step``, ``compute_loss`` (old signature without
``num_items_in_batch`` included), ``get_batch_samples``. These methods keep no state: the loss settings are the
Trainer's :class:`~shardkit.trainer.loss.LossSettings`, and the input counts an :class:`InputCounter`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shardkit.trainer.loss import LossMode, count_label_items, logits_of, loss_from_logits, loss_of, warn_mean_once

__all__ = ["InputCounter", "TrainingStepMixin"]

logger = logging.getLogger("shardkit.trainer")


class TrainingStepMixin:
    """training_step, compute_loss and get_batch_samples: Hugging Face's override seams, on the Trainer.

    Attributes:
        loss_is_scaled_for_ga: whether ``compute_loss`` returns the micro-batch's share of the window's loss
            (True) or a micro-batch mean that training_step divides over the window (False). None (default):
            scaled when ``compute_loss`` takes ``num_items_in_batch``. Subclasses with their own loss set it.
    """

    loss_is_scaled_for_ga: bool | None = None

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int,
                          device: Any = None) -> tuple[list[Any], torch.Tensor]:
        """The next ``num_batches`` batches of the epoch and the label items of that window on all ranks."""
        window = list(itertools.islice(epoch_iterator, num_batches))
        if not window:
            return window, torch.tensor(1)
        return window, self.loss_settings.count_window(window, self.label_names[0])

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | None = None):
        """Forward and backward of one micro-batch; returns its detached share of the window's loss."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        settings = self.loss_settings
        with self.compute_loss_context_manager():
            if settings.takes_items:
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            else:  # an override with HF's old signature returns a micro-batch mean
                loss = self.compute_loss(model, inputs)
        scaled = self.loss_is_scaled_for_ga
        if not (settings.takes_items if scaled is None else scaled):
            loss = loss / settings.backward_scale  # a micro-batch mean: its share of the window
        if self.prepared.done:
            stepper = self.prepared.backward_stepper  # LOMO/AdaLomo: fused_backward replaces the Runner's backward
            (stepper.backward if stepper is not None else self.runner.backward)(loss * settings.backward_scale)
        else:  # called before the Trainer set up the model (e.g. directly in a test): plain autograd
            (loss * settings.backward_scale).backward()
        return loss.detach()

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None):
        """The micro-batch's loss. Given ``num_items_in_batch`` (the label items of the whole window on all
        ranks) it returns this micro-batch's summed loss divided by it; without, the micro-batch mean."""
        settings = self.loss_settings
        labels_present = all(inputs.get(k) is not None for k in self.label_names)
        if settings.mode == LossMode.OWN and labels_present and len(self.label_names) == 1:
            features = {k: v for k, v in inputs.items() if k not in self.label_names}
            labels = inputs[self.label_names[0]]
            outputs = model(**features)
            items = num_items_in_batch if num_items_in_batch is not None else \
                max(count_label_items(labels, settings.shift_labels), 1)
            if self.compute_loss_func is not None:
                loss = self.compute_loss_func(outputs, labels, num_items_in_batch=items)
            else:
                loss = loss_from_logits(logits_of(outputs, None), labels, items, settings.shift_labels,
                                        self.args.label_smoothing_factor)
        elif settings.mode == LossMode.NUM_ITEMS and num_items_in_batch is not None:
            outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
            loss = loss_of(outputs)
        else:
            outputs = model(**inputs)
            loss = loss_of(outputs)
            if num_items_in_batch is not None and settings.mode == LossMode.RESCALE:
                local = count_label_items(inputs.get(self.label_names[0]), settings.shift_labels)
                loss = loss * (local / settings.window_items)
            elif num_items_in_batch is not None:
                warn_mean_once(type(self.runner.unwrap_model(model)).__name__)
                loss = loss / settings.backward_scale
        return (loss, outputs) if return_outputs else loss

    def _prepare_inputs(self, inputs: Any) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise TypeError(f"the Trainer feeds batches to model(**batch), so a batch must be a dict, not "
                            f"{type(inputs).__name__}: return dicts from the dataset or the data_collator")
        return inputs


class InputCounter:
    """Input tokens of the windows trained since the last :meth:`flush` (``include_num_input_tokens_seen``),
    counted on this rank and summed over ranks at the flush (once per log or save, not per step)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.tokens = 0
        self.warned = False

    def reset(self) -> None:
        self.tokens = 0

    def add(self, batch: Mapping[str, Any], mode: str, input_name: str, pad_token_id: int | None) -> None:
        """Count a batch's tokens: all (``mode="all"``), or those not padding (``"non_padding"``: the attention
        mask's, else the ids that are not ``pad_token_id``)."""
        if mode == "no":
            return
        ids = batch.get(input_name)
        if not isinstance(ids, torch.Tensor):
            self._warn_once(f"include_num_input_tokens_seen: the batches have no {input_name!r} tensor (the "
                            "model's main_input_name); no tokens are counted")
            return
        if mode == "all":
            self.tokens += ids.numel()
            return
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            self.tokens += int(mask.sum())
        elif pad_token_id is not None:
            self.tokens += int((ids != pad_token_id).sum())
        else:
            self._warn_once("Could not determine method to count non-padding tokens (no attention_mask and no "
                            "pad_token_id), falling back to counting all tokens")
            self.tokens += ids.numel()

    def _warn_once(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            logger.warning(message)

    def flush(self) -> int:
        """The tokens counted since the last flush on every rank together (a collective); the count restarts."""
        counts = torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.runner.device)
        if self.runner.world_size > 1:
            counts = self.runner.all_reduce(counts, "sum")
        self.tokens = 0
        return int(counts[0].item())
