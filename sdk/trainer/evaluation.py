"""Evaluation and prediction: gathered with ``gather_for_metrics`` semantics, kept off the device.

Each batch's predictions are gathered from every rank (the padding duplicates of an uneven split
dropped) and moved to the CPU at once, or fed to ``compute_metrics(..., compute_result=...)`` batch by
batch with ``batch_eval_metrics=True`` (nothing is kept), or written to a ``.npy`` file per output by
``predict(..., output_dir=...)``. The Trainer's methods here are Hugging Face's override seams and keep no
state: an evaluation's is an :class:`EvalAccumulator`, made for each run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from shardkit.trainer.loss import LossMode, count_label_items, logits_of, loss_from_logits, loss_of
from shardkit.trainer.optim_modes import to_eval
from shardkit.utils.operations import batch_size

__all__ = ["EvalAccumulator", "EvalLoopOutput", "EvalPrediction", "EvaluationMixin", "PredictionOutput",
           "cast_for_full_eval", "gather_padded", "stream_predictions", "timed_metrics"]


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
    num_steps: int = 0


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
        self.memory_tracker.start("eval")
        self.ensure_setup()
        cast_for_full_eval(self.args, self.runner, self.model_wrapped, self.is_in_train)
        to_eval(self)  # schedule-free: evaluate the averaged weights
        start = time.perf_counter()
        output = self.evaluation_loop(self.get_eval_dataloader(dataset), "Evaluation", self.compute_metrics is None
                                      or self.args.prediction_loss_only, ignore_keys, metric_key_prefix)
        metrics = timed_metrics(output, metric_key_prefix, start)
        self.memory_tracker.stop("eval")
        self.memory_tracker.update_metrics("eval", metrics)
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
        self.memory_tracker.start("test")
        self.ensure_setup()
        cast_for_full_eval(self.args, self.runner, self.model_wrapped, self.is_in_train)
        to_eval(self)  # schedule-free: evaluate the averaged weights
        start = time.perf_counter()
        output = self.evaluation_loop(self.get_test_dataloader(test_dataset), "Prediction", False, ignore_keys,
                                      metric_key_prefix, stream_to=output_dir)
        metrics = timed_metrics(output, metric_key_prefix, start)
        self.memory_tracker.stop("test")
        self.memory_tracker.update_metrics("test", metrics)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics=metrics)
        return PredictionOutput(output.predictions, output.label_ids, metrics)

    def evaluation_loop(self, loader, description: str, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                        stream_to: str | Path | None = None) -> EvalLoopOutput:
        """Loss over every sample once; predictions gathered per batch and moved to the CPU (or streamed)."""
        model, args = self.model_wrapped, self.args
        model.eval()
        self.callback_handler.eval_dataloader = loader
        kept = EvalAccumulator(args.include_for_metrics, getattr(self.model, "main_input_name", "input_ids"))
        runner = self.runner
        limit = args.fast_dev_run or None
        batch_metrics = args.batch_eval_metrics and self.compute_metrics is not None and not prediction_loss_only
        steps = 0
        for step, inputs, last in _batches_marking_the_last(loader, limit):
            steps = step + 1
            loss, logits, label = self.prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            if loss is not None:
                size = batch_size(inputs)
                kept.losses.append(runner.gather_for_metrics(loss.detach().float().reshape(1).repeat(size)).cpu())
            logits = gather_padded(runner, logits) if logits is not None else None
            label = gather_padded(runner, label) if label is not None else None
            if logits is not None and self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, label)
            if kept.want_inputs and isinstance(inputs.get(kept.input_name), torch.Tensor):
                kept.inputs.append(gather_padded(runner, inputs[kept.input_name]))
            if batch_metrics:  # tensors, as Hugging Face hands them (on the CPU, gathered from every rank)
                kept.result = self.compute_metrics(kept.prediction(logits, label, last_only=True), compute_result=last)
            if stream_to is not None and logits is not None:
                kept.files.append(stream_predictions(runner, logits, stream_to, step))
            elif not batch_metrics or description == "Prediction":  # evaluate() with batch metrics keeps nothing
                kept.add(logits, label)
            self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)
        model.train()
        return kept.output(self.compute_metrics, args.eval_do_concat_batches, batch_metrics, steps, loader)

    def prediction_step(self, model, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) of one batch without gradients; loss is the batch's mean over its label items."""
        inputs = self._prepare_inputs(inputs)
        label_names = self.label_names
        has_labels = all(inputs.get(k) is not None for k in label_names)
        labels = tuple(inputs[k] for k in label_names) if has_labels else None
        labels = labels[0] if labels is not None and len(labels) == 1 else labels
        settings = self.loss_settings
        with torch.no_grad():
            if has_labels and settings.mode in (LossMode.OWN, LossMode.RESCALE) and len(label_names) == 1:
                # Logits first, then the mean loss from them: one forward gives both, for any model we own the loss of.
                features = {k: v for k, v in inputs.items() if k not in label_names}
                logits = logits_of(model(**features), ignore_keys)
                count = count_label_items(labels, settings.shift_labels)
                loss = loss_from_logits(logits, labels, max(count, 1), settings.shift_labels,
                                        self.args.label_smoothing_factor) if count else None
            else:
                outputs = model(**inputs)
                loss = loss_of(outputs) if has_labels else None
                logits = None if prediction_loss_only else logits_of(outputs, ignore_keys, has_labels)
                if logits is None and not prediction_loss_only and has_labels:
                    features = {k: v for k, v in inputs.items() if k not in label_names}
                    logits = logits_of(model(**features), ignore_keys)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, labels


class EvalAccumulator:
    """What one evaluation keeps across batches (gathered, on the CPU) and the output it makes of them."""

    def __init__(self, include_for_metrics: list[str], input_name: str):
        self.want_inputs, self.want_loss = "inputs" in include_for_metrics, "loss" in include_for_metrics
        self.input_name = input_name
        self.losses: list[torch.Tensor] = []
        self.preds: list[Any] = []
        self.labels: list[Any] = []
        self.inputs: list[torch.Tensor] = []
        self.files: list[str] = []
        self.result: Any = None

    def add(self, logits: Any, label: Any) -> None:
        if logits is not None:
            self.preds.append(logits)
        if label is not None:
            self.labels.append(label)

    @staticmethod
    def joined(parts: list[Any], concat: bool) -> Any:
        """One array over the batches (``eval_do_concat_batches``), else the list of per-batch arrays."""
        if not parts:
            return None
        return _to_numpy(_concat(parts)) if concat else [_to_numpy(p) for p in parts]

    def prediction(self, predictions: Any, label_ids: Any, last_only: bool = False) -> EvalPrediction:
        """EvalPrediction with the inputs and per-sample losses ``include_for_metrics`` asks for."""
        inputs = losses = None
        if self.want_inputs and self.inputs:
            inputs = self.inputs[-1] if last_only else _to_numpy(_concat(self.inputs))
        if self.want_loss and self.losses:
            losses = self.losses[-1] if last_only else _to_numpy(torch.cat(self.losses))
        return EvalPrediction(predictions, label_ids, inputs=inputs, losses=losses)

    def output(self, compute_metrics: Any, concat: bool, batch_metrics: bool, steps: int, loader: Any
               ) -> EvalLoopOutput:
        """The loop's output: predictions, labels, and the metrics (``compute_metrics``' and the mean loss)."""
        predictions = self.files or self.joined(self.preds, concat)
        label_ids = self.joined(self.labels, concat)
        metrics: dict[str, float] = {}
        if batch_metrics and self.result is not None:  # compute_result=True on the last batch gave the metrics
            metrics = dict(self.result)
        elif compute_metrics is not None and predictions is not None and label_ids is not None and not self.files:
            metrics = dict(compute_metrics(self.prediction(predictions, label_ids)))
        all_losses = torch.cat(self.losses) if self.losses else None
        if all_losses is not None:
            metrics["loss"] = float(all_losses.mean())
        num = len(all_losses) if all_losses is not None else steps * (loader.batch_size or 1)
        metrics = {k: (float(v) if isinstance(v, (np.floating, np.integer, torch.Tensor)) else v)
                   for k, v in metrics.items()}
        return EvalLoopOutput(predictions, label_ids, metrics, num, steps)


def cast_for_full_eval(args: Any, runner: Any, model: Any, in_train: bool) -> None:
    """``fp16_full_eval``/``bf16_full_eval`` outside training: the model itself is cast (half the memory),
    as Hugging Face does; during training evaluation keeps the training dtypes."""
    dtype = torch.float16 if args.fp16_full_eval else torch.bfloat16 if args.bf16_full_eval else None
    if dtype is None or in_train:
        return
    strategy = runner.strategy
    if strategy.partitions_parameters or strategy.optimizer_parameters != "whole":
        raise ValueError(f"{'fp16' if args.fp16_full_eval else 'bf16'}_full_eval casts the whole model, which "
                         f"{type(strategy).__name__} keeps partitioned: use bf16=True / fp16=True (mixed "
                         "precision) for evaluation under this strategy")
    runner.unwrap_model(model).to(dtype)


def timed_metrics(output: EvalLoopOutput, prefix: str, start: float) -> dict[str, float]:
    """The loop's metrics named ``<prefix>_<name>``, with the runtime and rates since ``start``."""
    runtime = time.perf_counter() - start
    metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in output.metrics.items()}
    metrics[f"{prefix}_runtime"] = round(runtime, 4)
    metrics[f"{prefix}_samples_per_second"] = round(output.num_samples / max(runtime, 1e-9), 3)
    metrics[f"{prefix}_steps_per_second"] = round(output.num_steps / max(runtime, 1e-9), 3)
    return metrics


def gather_padded(runner: Any, value: Any) -> Any:
    """gather_for_metrics for a tensor (or tuple of them) whose dims after the first may differ by rank: padded
    with -100 to the widest rank's second dimension first; on the CPU."""
    if isinstance(value, (list, tuple)):
        return type(value)(gather_padded(runner, v) for v in value)
    value = value.detach()
    if value.ndim >= 2 and runner.world_size > 1:
        width = runner.all_reduce(torch.tensor([value.shape[1]], device=value.device), "max")
        extra = int(width.item()) - value.shape[1]
        if extra:
            pad = [0, 0] * (value.ndim - 2) + [0, extra]
            value = torch.nn.functional.pad(value, pad, value=-100)
    return runner.gather_for_metrics(value).cpu()


def stream_predictions(runner: Any, logits: Any, directory: str | Path, step: int) -> str:
    """Write one batch's gathered predictions to ``<directory>/predictions-<step>.npy`` (main process)."""
    path = Path(directory) / f"predictions-{step:06d}.npy"
    if runner.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, _to_numpy(logits[0] if isinstance(logits, (list, tuple)) else logits))
    return str(path)


_END = object()


def _batches_marking_the_last(loader: Any, limit: int | None) -> Iterator[tuple[int, Any, bool]]:
    """``(step, batch, is_last)`` for the batches to evaluate (at most ``limit``). A stream's length is not known
    ahead: the Runner's stream loader reads one batch ahead and says when the one in use is the last (``at_end``),
    which its duplicate mask reads too, so it is not read ahead again here; any other loader without a length is."""
    try:
        steps = len(loader) if limit is None else min(limit, len(loader))
    except TypeError:
        steps = None
    if steps is not None:
        for step, batch in enumerate(loader):
            if step >= steps:
                return
            yield step, batch, step == steps - 1
        return
    if hasattr(loader, "at_end"):
        for step, batch in enumerate(loader):
            yield step, batch, loader.at_end or step + 1 == limit
            if step + 1 == limit:
                return
        return
    iterator, step = iter(loader), 0
    pending = next(iterator, _END)
    while pending is not _END:
        batch = pending
        pending = next(iterator, _END) if limit is None or step + 1 < limit else _END
        yield step, batch, pending is _END
        step += 1
