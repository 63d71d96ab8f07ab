"""One optimizer step's micro-batches: the window's label count, each micro-batch's forward and backward, and the
loss it contributes (see ``shardkit.trainer.loss`` for why the loss is exact under accumulation and ranks).

Overridable as in Hugging Face's Trainer: ``training_step``, ``compute_loss`` (old signature without
``num_items_in_batch`` included), ``get_batch_samples``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from shardkit.trainer.evaluation import _loss_of
from shardkit.trainer.loss import LossMode, count_label_items, loss_from_logits, warn_mean_once

__all__ = ["TrainingStepMixin"]

logger = logging.getLogger("shardkit.trainer")


class TrainingStepMixin:
    """training_step, compute_loss and the window bookkeeping; mixed into Trainer.

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
        return window, (self._count_window(window) if window else torch.tensor(1))

    def _dp_size(self) -> int:
        return self.runner.strategy.data_parallel_size

    def _count_window(self, window: list[Any]) -> torch.Tensor:
        """Label items of the whole window: this rank's micro-batches, summed over ranks (one all-reduce)."""
        label = self.label_names[0]
        local = sum(count_label_items(b.get(label) if isinstance(b, Mapping) else None, self._shift_labels)
                    for b in window)
        count = torch.tensor([float(local)], dtype=torch.float64, device=self.runner.device)
        if self.args.average_tokens_across_devices and self.runner.world_size > 1:
            count = self.runner.all_reduce(count, "sum") * (self._dp_size() / self.runner.world_size)
        self._window_items = max(int(round(count.item())), 1)
        return torch.tensor(self._window_items, device=self.runner.device)

    @property
    def _backward_scale(self) -> int:
        # The Runner divides by the window length and data parallelism averages over ranks; a loss already
        # normalised by the whole window's count is multiplied back by both.
        ranks = self._dp_size() if self.args.average_tokens_across_devices else 1
        return self._window_len * ranks

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | None = None):
        """Forward and backward of one micro-batch; returns its detached share of the window's loss."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            if self._compute_loss_takes_items:
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            else:  # an override with HF's old signature returns a micro-batch mean
                loss = self.compute_loss(model, inputs)
        scaled = self.loss_is_scaled_for_ga
        if not (self._compute_loss_takes_items if scaled is None else scaled):
            loss = loss / self._backward_scale  # a micro-batch mean: its share of the window
        if self._setup_done:
            stepper = self._backward_stepper  # LOMO/AdaLomo: fused_backward replaces the Runner's backward
            (stepper.backward if stepper is not None else self.runner.backward)(loss * self._backward_scale)
        else:  # called before the Trainer set up the model (e.g. directly in a test): plain autograd
            (loss * self._backward_scale).backward()
        return loss.detach()

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | None = None):
        """The micro-batch's loss. Given ``num_items_in_batch`` (the label items of the whole window on all
        ranks) it returns this micro-batch's summed loss divided by it; without, the micro-batch mean."""
        labels_present = all(inputs.get(k) is not None for k in self.label_names)
        if self._loss_mode == LossMode.OWN and labels_present and len(self.label_names) == 1:
            features = {k: v for k, v in inputs.items() if k not in self.label_names}
            labels = inputs[self.label_names[0]]
            outputs = model(**features)
            items = num_items_in_batch if num_items_in_batch is not None else \
                max(count_label_items(labels, self._shift_labels), 1)
            if self.compute_loss_func is not None:
                loss = self.compute_loss_func(outputs, labels, num_items_in_batch=items)
            else:
                logits = self._logits_of(outputs, None)
                loss = loss_from_logits(logits, labels, items, self._shift_labels, self.args.label_smoothing_factor)
        elif self._loss_mode == LossMode.NUM_ITEMS and num_items_in_batch is not None:
            outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
            loss = _loss_of(outputs)
        else:
            outputs = model(**inputs)
            loss = _loss_of(outputs)
            if num_items_in_batch is not None and self._loss_mode == LossMode.RESCALE:
                local = count_label_items(inputs.get(self.label_names[0]), self._shift_labels)
                loss = loss * (local / self._window_items)
            elif num_items_in_batch is not None:
                warn_mean_once(type(self.runner.unwrap_model(model)).__name__)
                loss = loss / self._backward_scale
        return (loss, outputs) if return_outputs else loss

    def _prepare_inputs(self, inputs: Any) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise TypeError(f"the Trainer feeds batches to model(**batch), so a batch must be a dict, not "
                            f"{type(inputs).__name__}: return dicts from the dataset or the data_collator")
        return inputs

    # ---- counts for logs and metrics --------------------------------------------------------------

    def _count_inputs(self, window: list[Any]) -> None:
        """Input tokens (``include_num_input_tokens_seen``), samples and flos of a window, added locally; the
        token count reaches ``state.num_input_tokens_seen`` over all ranks at the next :meth:`_flush_counts`."""
        mode = self.args.include_num_input_tokens_seen
        for batch in window:
            if not isinstance(batch, Mapping):
                continue
            self.current_flos += float(self.floating_point_ops(batch))
            self._samples_local += _rows_of(batch)
            if mode != "no":
                self._tokens_local += self._tokens_of(batch, mode)

    def _tokens_of(self, batch: Mapping[str, Any], mode: str) -> int:
        name = getattr(self.model, "main_input_name", "input_ids")
        ids = batch.get(name)
        if not isinstance(ids, torch.Tensor):
            self._warn_tokens_once(f"include_num_input_tokens_seen: the batches have no {name!r} tensor (the "
                                   "model's main_input_name); no tokens are counted")
            return 0
        if mode == "all":
            return ids.numel()
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        pad = getattr(self.processing_class, "pad_token_id", None)
        if pad is not None:
            return int((ids != pad).sum())
        self._warn_tokens_once("Could not determine method to count non-padding tokens (no attention_mask and no "
                               "pad_token_id), falling back to counting all tokens")
        return ids.numel()

    def _warn_tokens_once(self, message: str) -> None:
        if not getattr(self, "_tokens_warned", False):
            self._tokens_warned = True
            logger.warning(message)

    def _flush_counts(self) -> None:
        """Add the tokens counted since the last flush, over every rank, to ``state.num_input_tokens_seen``."""
        counts = torch.tensor([float(self._tokens_local), float(self._samples_local)], dtype=torch.float64,
                              device=self.runner.device)
        if self.runner.world_size > 1:
            counts = self.runner.all_reduce(counts, "sum")
        self.state.num_input_tokens_seen += int(counts[0].item())
        self._tokens_local, self._samples_local = 0, 0


def _rows_of(batch: Mapping[str, Any]) -> int:
    first = next(iter(batch.values()), None)
    return first.shape[0] if isinstance(first, torch.Tensor) and first.ndim else 1
