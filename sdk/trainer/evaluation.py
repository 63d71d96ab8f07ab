"""Evaluation and prediction: gathered with ``gather_for_metrics`` semantics, kept off the device.

Each batch's predictions are gathered from every rank (the padding duplicates of an uneven split
dropped) and moved to the CPU at once, or fed to ``compute_metrics(..., compute_result=...)`` batch by
batch with ``batch_eval_metrics=True`` (nothing is kept), or written to a ``.npy`` file per output by
``predict(..., output_dir=...)``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from shardkit.trainer.loss import LossMode, count_label_items, loss_from_logits
from shardkit.trainer.optim_modes import to_eval

__all__ = ["EvalPrediction", "EvalLoopOutput", "PredictionOutput", "EvaluationMixin"]


class EvalPrediction:
    """What ``compute_metrics`` receives: ``predictions`` and ``label_ids`` (numpy), unpackable as a pair."""

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None):
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses

    def __iter__(self):
        return iter((self.predictions, self.label_ids))

    def __getitem__(self, index: int) -> Any:
        return (self.predictions, self.label_ids)[index]


class EvalLoopOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float]
    num_samples: int


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float().numpy() if value.dtype in (torch.bfloat16, torch.float16) else value.numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_numpy(v) for v in value)
    return value


def _concat(parts: list[Any]) -> Any:
    """Concatenate per-batch outputs on the first dim, padding later dims with -100 where lengths differ."""
    first = parts[0]
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    if first.ndim <= 1:
        return torch.cat(parts)
    widths = [max(p.shape[d] for p in parts) for d in range(1, first.ndim)]
    padded = [torch.nn.functional.pad(p, [x for d in reversed(range(1, p.ndim))
                                          for x in (0, widths[d - 1] - p.shape[d])], value=-100) for p in parts]
    return torch.cat(padded)


class EvaluationMixin:
    """evaluate(), predict() and the loop under them; mixed into Trainer."""

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Run the eval set(s) and return metrics named ``<prefix>_<name>`` (``eval_loss``, ``eval_accuracy`` ...).

        A dict of eval datasets is evaluated one by one, each with prefix ``<prefix>_<key>``.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval dataset: pass Trainer(eval_dataset=...) or evaluate(dataset)")
        if isinstance(dataset, Mapping):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        self._ensure_setup()
        to_eval(self)  # schedule-free: evaluate the averaged weights
        start = time.perf_counter()
        output = self.evaluation_loop(self._eval_loader(dataset), "Evaluation", self.compute_metrics is None
                                      or self.args.prediction_loss_only, ignore_keys, metric_key_prefix)
        metrics = self._finish_metrics(output, metric_key_prefix, start)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test",
                output_dir: str | Path | None = None) -> PredictionOutput:
        """Predictions (numpy, every sample once in dataset order), label ids and metrics for ``test_dataset``.

        With ``output_dir``, each batch's gathered predictions are written by the main process to
        ``<output_dir>/predictions-<batch>.npy`` as they come, nothing is kept in memory, and
        ``predictions`` in the result is the list of those files.
        """
        self._ensure_setup()
        to_eval(self)  # schedule-free: evaluate the averaged weights
        start = time.perf_counter()
        output = self.evaluation_loop(self._eval_loader(test_dataset), "Prediction", False, ignore_keys,
                                      metric_key_prefix, stream_to=output_dir)
        metrics = self._finish_metrics(output, metric_key_prefix, start)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics=metrics)
        return PredictionOutput(output.predictions, output.label_ids, metrics)

    def _finish_metrics(self, output: EvalLoopOutput, prefix: str, start: float) -> dict[str, float]:
        runtime = time.perf_counter() - start
        metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in output.metrics.items()}
        metrics[f"{prefix}_runtime"] = round(runtime, 4)
        metrics[f"{prefix}_samples_per_second"] = round(output.num_samples / max(runtime, 1e-9), 3)
        return metrics

    def _eval_loader(self, dataset: Any):
        # Set up anew for each run: gather_for_metrics drops the duplicates of the loader set up last.
        loader = DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, shuffle=False,
                            collate_fn=self._collator_for(dataset), num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)
        return self.runner.setup_dataloader(loader)

    def evaluation_loop(self, loader, description: str, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                        stream_to: str | Path | None = None) -> EvalLoopOutput:
        """Loss over every sample once; predictions gathered per batch and moved to the CPU (or streamed)."""
        model, runner, args = self.model, self.runner, self.args
        model.eval()
        self.callback_handler.eval_dataloader = loader
        losses, preds, labels, files, result = [], [], [], [], None
        limit = args.fast_dev_run or None
        batch_metrics = args.batch_eval_metrics and self.compute_metrics is not None and not prediction_loss_only
        steps = len(loader) if limit is None else min(limit, len(loader))
        for step, inputs in enumerate(loader):
            if limit is not None and step >= limit:
                break
            loss, logits, label = self.prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            size = _batch_size(inputs)
            if loss is not None:
                losses.append(runner.gather_for_metrics(loss.detach().float().reshape(1).repeat(size)).cpu())
            logits = self._gather(logits) if logits is not None else None
            label = self._gather(label) if label is not None else None
            if logits is not None and self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, label)
            if batch_metrics:
                result = self.compute_metrics(EvalPrediction(_to_numpy(logits), _to_numpy(label)),
                                              compute_result=step == steps - 1)
            elif stream_to is not None and logits is not None:
                files.append(self._stream(logits, stream_to, step))
            else:
                preds.append(logits) if logits is not None else None
                labels.append(label) if label is not None else None
            self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)
        model.train()
        return self._loop_output(losses, preds, labels, files, result if batch_metrics else None, steps, loader)

    def _loop_output(self, losses, preds, labels, files, batch_result, steps, loader) -> EvalLoopOutput:
        predictions = files if files else (_to_numpy(_concat(preds)) if preds else None)
        label_ids = _to_numpy(_concat(labels)) if labels else None
        metrics: dict[str, float] = {}
        if batch_result is not None:  # compute_result=True on the last batch returned the run's metrics
            metrics = dict(batch_result)
        elif self.compute_metrics is not None and predictions is not None and label_ids is not None and not files:
            metrics = dict(self.compute_metrics(EvalPrediction(predictions, label_ids)))
        all_losses = torch.cat(losses) if losses else None
        if all_losses is not None:
            metrics["loss"] = float(all_losses.mean())
        num = len(all_losses) if all_losses is not None else steps * (loader.batch_size or 1)
        metrics = {k: (float(v) if isinstance(v, (np.floating, np.integer, torch.Tensor)) else v)
                   for k, v in metrics.items()}
        return EvalLoopOutput(predictions, label_ids, metrics, num)

    def _gather(self, value: Any) -> Any:
        """gather_for_metrics for a tensor (or tuple of them) whose dims after the first may differ by rank."""
        if isinstance(value, (list, tuple)):
            return type(value)(self._gather(v) for v in value)
        value = value.detach()
        if value.ndim >= 2 and self.runner.world_size > 1:
            width = self.runner.all_reduce(torch.tensor([value.shape[1]], device=value.device), "max")
            extra = int(width.item()) - value.shape[1]
            if extra:
                pad = [0, 0] * (value.ndim - 2) + [0, extra]
                value = torch.nn.functional.pad(value, pad, value=-100)
        return self.runner.gather_for_metrics(value).cpu()

    def _stream(self, logits: Any, directory: str | Path, step: int) -> str:
        path = Path(directory) / f"predictions-{step:06d}.npy"
        if self.runner.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, _to_numpy(logits[0] if isinstance(logits, (list, tuple)) else logits))
        return str(path)

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) of one batch without gradients; loss is the batch's mean over its label items."""
        inputs = self._prepare_inputs(inputs)
        label_names = self.label_names
        has_labels = all(inputs.get(k) is not None for k in label_names)
        labels = tuple(inputs[k] for k in label_names) if has_labels else None
        labels = labels[0] if labels is not None and len(labels) == 1 else labels
        with torch.no_grad():
            if has_labels and self._loss_mode in (LossMode.OWN, LossMode.RESCALE) and len(label_names) == 1:
                # Logits first, then the mean loss from them: one forward gives both, for any model we own the loss of.
                features = {k: v for k, v in inputs.items() if k not in label_names}
                logits = self._logits_of(model(**features), ignore_keys)
                count = count_label_items(labels, self._shift_labels)
                loss = loss_from_logits(logits, labels, max(count, 1), self._shift_labels,
                                        self.args.label_smoothing_factor) if count else None
            else:
                outputs = model(**inputs)
                loss = _loss_of(outputs) if has_labels else None
                logits = None if prediction_loss_only else self._logits_of(outputs, ignore_keys, has_labels)
                if logits is None and not prediction_loss_only and has_labels:
                    features = {k: v for k, v in inputs.items() if k not in label_names}
                    logits = self._logits_of(model(**features), ignore_keys)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, labels

    def _logits_of(self, outputs: Any, ignore_keys: list[str] | None, has_loss: bool = False) -> Any:
        if isinstance(outputs, torch.Tensor):
            return None if outputs.ndim == 0 else outputs
        if isinstance(outputs, Mapping):
            skip = set(ignore_keys or []) | {"loss", "past_key_values", "hidden_states", "attentions"}
            values = tuple(v for k, v in outputs.items() if k not in skip and isinstance(v, torch.Tensor))
        else:
            values = tuple(outputs[1:] if has_loss else outputs)
        if not values:
            return None
        return values[0] if len(values) == 1 else values


def _loss_of(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        if outputs.get("loss") is None:
            raise ValueError(f"the model returned no loss (keys {list(outputs)}); pass labels or compute_loss_func")
        return outputs["loss"]
    return outputs[0]


def _batch_size(inputs: Any) -> int:
    if isinstance(inputs, torch.Tensor):
        return inputs.shape[0]
    if isinstance(inputs, Mapping):
        return _batch_size(next(iter(inputs.values())))
    return _batch_size(inputs[0])
