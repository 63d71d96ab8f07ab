"""Evaluation and prediction: gathered with ``gather_for_metrics`` semantics, kept off the device.

Each batch's predictions are gathered from every rank (the padding duplicates of an uneven split
dropped) and moved to the CPU at once, or fed to ``compute_metrics(..., compute_result=...)`` batch by
batch with ``batch_eval_metrics=True`` (nothing is kept), or written to a ``.npy`` file per output by
``predict(..., output_dir=...)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

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
        self._memory.start("eval")
        self._ensure_setup()
        self._prepare_full_eval()
        to_eval(self)  # schedule-free: evaluate the averaged weights
        start = time.perf_counter()
        output = self.evaluation_loop(self.get_eval_dataloader(dataset), "Evaluation", self.compute_metrics is None
                                      or self.args.prediction_loss_only, ignore_keys, metric_key_prefix)
        metrics = self._finish_metrics(output, metric_key_prefix, start)
        self._memory.stop("eval")
        self._memory.update_metrics("eval", metrics)
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
        self._memory.start("test")
        self._ensure_setup()
        self._prepare_full_eval()
        to_eval(self)  # schedule-free: evaluate the averaged weights
        start = time.perf_counter()
        output = self.evaluation_loop(self.get_test_dataloader(test_dataset), "Prediction", False, ignore_keys,
                                      metric_key_prefix, stream_to=output_dir)
        metrics = self._finish_metrics(output, metric_key_prefix, start)
        self._memory.stop("test")
        self._memory.update_metrics("test", metrics)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics=metrics)
        return PredictionOutput(output.predictions, output.label_ids, metrics)

    def _prepare_full_eval(self) -> None:
        """``fp16_full_eval``/``bf16_full_eval`` outside training: the model itself is cast (half the memory),
        as Hugging Face does; during training evaluation keeps the training dtypes."""
        args = self.args
        dtype = torch.float16 if args.fp16_full_eval else torch.bfloat16 if args.bf16_full_eval else None
        if dtype is None or self.is_in_train:
            return
        strategy = self.runner.strategy
        if strategy.partitions_parameters or strategy.optimizer_parameters != "whole":
            raise ValueError(f"{'fp16' if args.fp16_full_eval else 'bf16'}_full_eval casts the whole model, which "
                             f"{type(strategy).__name__} keeps partitioned: use bf16=True / fp16=True (mixed "
                             "precision) for evaluation under this strategy")
        self.runner.unwrap_model(self.model_wrapped).to(dtype)

    def _finish_metrics(self, output: EvalLoopOutput, prefix: str, start: float) -> dict[str, float]:
        runtime = time.perf_counter() - start
        metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": v for k, v in output.metrics.items()}
        metrics[f"{prefix}_runtime"] = round(runtime, 4)
        metrics[f"{prefix}_samples_per_second"] = round(output.num_samples / max(runtime, 1e-9), 3)
        metrics[f"{prefix}_steps_per_second"] = round(output.num_steps / max(runtime, 1e-9), 3)
        return metrics

    def evaluation_loop(self, loader, description: str, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                        stream_to: str | Path | None = None) -> EvalLoopOutput:
        """Loss over every sample once; predictions gathered per batch and moved to the CPU (or streamed)."""
        model, args = self.model_wrapped, self.args
        model.eval()
        self.callback_handler.eval_dataloader = loader
        kept = _Kept(args.include_for_metrics, getattr(self.model, "main_input_name", "input_ids"))
        limit = args.fast_dev_run or None
        batch_metrics = args.batch_eval_metrics and self.compute_metrics is not None and not prediction_loss_only
        steps = 0
        for step, inputs, last in _batches_marking_the_last(loader, limit):
            steps = step + 1
            loss, logits, label = self.prediction_step(model, inputs, prediction_loss_only, ignore_keys)
            if loss is not None:
                size = _batch_size(inputs)
                kept.losses.append(self.runner.gather_for_metrics(loss.detach().float().reshape(1).repeat(size)).cpu())
            logits = self._gather(logits) if logits is not None else None
            label = self._gather(label) if label is not None else None
            if logits is not None and self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, label)
            if kept.want_inputs and isinstance(inputs.get(kept.input_name), torch.Tensor):
                kept.inputs.append(self._gather(inputs[kept.input_name]))
            if batch_metrics:  # tensors, as Hugging Face hands them (on the CPU, gathered from every rank)
                kept.result = self.compute_metrics(self._prediction(logits, label, kept, last_only=True),
                                                   compute_result=last)
            if stream_to is not None and logits is not None:
                kept.files.append(self._stream(logits, stream_to, step))
            elif not batch_metrics or description == "Prediction":  # evaluate() with batch metrics keeps nothing
                kept.add(logits, label)
            self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)
        model.train()
        return self._loop_output(kept, batch_metrics, steps, loader)

    def _prediction(self, predictions: Any, label_ids: Any, kept: _Kept, last_only: bool = False) -> EvalPrediction:
        """EvalPrediction with the inputs and per-sample losses ``include_for_metrics`` asks for."""
        inputs = losses = None
        if kept.want_inputs and kept.inputs:
            inputs = kept.inputs[-1] if last_only else _to_numpy(_concat(kept.inputs))
        if kept.want_loss and kept.losses:
            losses = kept.losses[-1] if last_only else _to_numpy(torch.cat(kept.losses))
        return EvalPrediction(predictions, label_ids, inputs=inputs, losses=losses)

    def _loop_output(self, kept: _Kept, batch_metrics: bool, steps: int, loader) -> EvalLoopOutput:
        concat = self.args.eval_do_concat_batches
        predictions = kept.files or kept.joined(kept.preds, concat)
        label_ids = kept.joined(kept.labels, concat)
        metrics: dict[str, float] = {}
        if batch_metrics and kept.result is not None:  # compute_result=True on the last batch gave the metrics
            metrics = dict(kept.result)
        elif self.compute_metrics is not None and predictions is not None and label_ids is not None \
                and not kept.files:
            metrics = dict(self.compute_metrics(self._prediction(predictions, label_ids, kept)))
        all_losses = torch.cat(kept.losses) if kept.losses else None
        if all_losses is not None:
            metrics["loss"] = float(all_losses.mean())
        num = len(all_losses) if all_losses is not None else steps * (loader.batch_size or 1)
        metrics = {k: (float(v) if isinstance(v, (np.floating, np.integer, torch.Tensor)) else v)
                   for k, v in metrics.items()}
        return EvalLoopOutput(predictions, label_ids, metrics, num, steps)

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


class _Kept:
    """What an evaluation keeps across batches (gathered, on the CPU)."""

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
