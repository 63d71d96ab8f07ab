"""Trainer: Hugging Face's Trainer API on shardkit's Runner, with exact loss, O(1) resume and lean evaluation.

    trainer = Trainer(model, TrainingArguments(output_dir="out", gradient_accumulation_steps=4),
                      train_dataset=train, eval_dataset=val, compute_metrics=accuracy)
    trainer.train(resume_from_checkpoint=True)

NOTE on epochs: an epoch takes ``len(loader) // gradient_accumulation_steps`` optimizer steps; the
micro-batches of a last incomplete window are not trained on (a warning says how many). The Runner
steps only at the end of a full window, so stepping on a partial one is not possible through its API.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader

from shardkit.strategies.activation_checkpointing import enable_gradient_checkpointing
from shardkit.trainer.arguments import TrainingArguments
from shardkit.trainer.backward_step import backward_stepper
from shardkit.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
)
from shardkit.trainer.checkpointing import CheckpointMixin
from shardkit.trainer.collate import ColumnFilter, default_collator
from shardkit.trainer.engine import (
    build_runner,
    create_optimizer,
    create_scheduler,
    estimate_world_size,
    steps_per_epoch,
    total_steps,
)
from shardkit.trainer.evaluation import EvaluationMixin, _loss_of
from shardkit.trainer.loss import (
    LossMode,
    accepts,
    count_label_items,
    is_causal_lm,
    loss_from_logits,
    loss_mode,
    warn_mean_once,
)
from shardkit.trainer.model_prep import apply_model_prep, maybe_compile
from shardkit.trainer.neftune import neftune
from shardkit.trainer.optim_modes import (
    check_optimizer_strategy,
    pass_eval_loss,
    pass_training_loss,
    to_eval,
    to_train,
)
from shardkit.trainer.peft_support import base_model_of, is_peft_model, save_peft_model
from shardkit.trainer.reporting import reporter_callbacks
from shardkit.trainer.state import TrainerControl, TrainerState

__all__ = ["Trainer", "TrainOutput"]

logger = logging.getLogger("shardkit.trainer")


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class Trainer(CheckpointMixin, EvaluationMixin):
    """Runs training, evaluation, checkpointing, logging and callbacks for a model (HF's Trainer API).

    Args:
        model: a torch module or HF PreTrainedModel (or give ``model_init``).
        args: TrainingArguments (default: ``TrainingArguments()``).
        data_collator: turns a list of samples into a batch dict (default: pad with ``processing_class`` if it
            can, else torch's default_collate).
        train_dataset, eval_dataset: map-style datasets of dicts; eval_dataset may be a dict of them.
        processing_class: tokenizer/processor, saved by ``save_model`` and used for padding.
        compute_loss_func: ``f(outputs, labels, num_items_in_batch=N)`` returning sum / N (the Trainer owns the loss).
        compute_metrics: ``f(EvalPrediction) -> dict`` (with ``batch_eval_metrics``: ``f(pred, compute_result)``).
        callbacks: TrainerCallback instances or classes added after the defaults.
        optimizers: ``(optimizer, scheduler)`` built over ``model.parameters()``; None builds them from ``args``.
        preprocess_logits_for_metrics: ``f(logits, labels)`` applied per batch before predictions are kept.
        strategy, precision: shardkit objects (e.g. ``FSDP()``, ``BF16()``) instead of the HF spellings in args.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, model_init=None, compute_loss_func=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None), preprocess_logits_for_metrics=None,
                 *, strategy=None, precision=None):
        self.args = args = args if args is not None else TrainingArguments()
        if model is None:
            if model_init is None:
                raise ValueError("Trainer needs a model (or model_init, a function that returns one)")
            model = model_init()
        apply_model_prep(model, args)  # fused kernels, before anything reads the model's forward
        self._user_model = self.model = model
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator, self.processing_class = data_collator, processing_class
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.label_names = list(args.label_names or ["labels"])
        owns = compute_loss_func is not None or args.label_smoothing_factor > 0 or not accepts(model, "labels")
        probe = base_model_of(model)  # a PeftModel forwards **kwargs: its base model says what the loss takes
        self._loss_mode = loss_mode(probe, owns)
        self._shift_labels = is_causal_lm(probe)
        max_steps, warmup = self._estimate_steps() if args.deepspeed else (None, None)
        self.runner, self._engine_spec = build_runner(args, strategy, precision, max_steps, warmup)
        enable_gradient_checkpointing(model, args, self.runner)  # an HF model's own, else the Runner's switch
        self._configure_logging()
        self.state = TrainerState(is_world_process_zero=self.runner.is_main_process,
                                  is_local_process_zero=self.runner.local_rank == 0)
        self.control = TrainerControl()
        defaults = [DefaultFlowCallback, *reporter_callbacks(args.report_to)]
        defaults.append(PrinterCallback if args.disable_tqdm else ProgressCallback)
        self.callback_handler = CallbackHandler(defaults + list(callbacks or []), self.model, processing_class,
                                                self.optimizer, self.lr_scheduler)
        self._setup_done = False
        self._train_loader = None
        self._pending_local: list[torch.Tensor] = []
        self._pending_global: list[float] = []
        self._loss_total = [0.0, 0]
        self._counts_local = torch.zeros(2, dtype=torch.float64)  # tokens, samples since the last log
        self._last_log_time = time.perf_counter()
        self._stop_signal = threading.Event()
        self._grad_norm = None
        self._backward_stepper = None  # set at setup for optimizers that update inside backward
        # A subclass's compute_loss with HF's old signature returns a micro-batch mean (checked once, not per step).
        self._compute_loss_takes_items = "num_items_in_batch" in inspect.signature(self.compute_loss).parameters
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    # ---- setup ------------------------------------------------------------------------------------

    def _configure_logging(self) -> None:
        args, runner = self.args, self.runner
        main = runner.local_rank == 0 if args.log_on_each_node else runner.is_main_process
        level = args.log_level if main else args.log_level_replica
        if level != "passive":
            for name in ("shardkit", "shardkit.trainer"):
                logging.getLogger(name).setLevel(level.upper())

    def _estimate_steps(self) -> tuple[int | None, int | None]:
        """Steps before the Runner exists (for DeepSpeed's "auto" total_num_steps and warmup)."""
        try:
            samples = math.ceil(len(self.train_dataset) / estimate_world_size())
        except TypeError:
            return (self.args.max_steps if self.args.max_steps > 0 else None), None
        batches = samples // self.args.per_device_train_batch_size if self.args.dataloader_drop_last else \
            math.ceil(samples / self.args.per_device_train_batch_size)
        max_steps, _ = total_steps(self.args, steps_per_epoch(batches, self.args.gradient_accumulation_steps))
        return max_steps, self.args.get_warmup_steps(max_steps)

    def _collator_for(self, dataset: Any):
        base = self.data_collator or default_collator(self.processing_class)
        if not self.args.remove_unused_columns:
            return base
        return ColumnFilter(base, self.runner.unwrap_model(self.model) if self._setup_done else self._user_model,
                            self.label_names)

    def get_train_dataloader(self) -> DataLoader:
        """A plain DataLoader over train_dataset; the Runner shards, shuffles and resumes it."""
        args = self.args
        kwargs: dict[str, Any] = {}
        if args.dataloader_num_workers > 0:
            kwargs.update(persistent_workers=args.dataloader_persistent_workers)
            if args.dataloader_prefetch_factor is not None:
                kwargs["prefetch_factor"] = args.dataloader_prefetch_factor
        return DataLoader(self.train_dataset, batch_size=args.per_device_train_batch_size, shuffle=True,
                          collate_fn=self._collator_for(self.train_dataset), drop_last=args.dataloader_drop_last,
                          num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory, **kwargs)

    def _ensure_setup(self) -> None:
        """Set up loader, model, optimizer and schedule with the Runner, once (train() or evaluate() first)."""
        if self._setup_done:
            return
        args, runner = self.args, self.runner
        max_steps = args.max_steps if args.max_steps > 0 else 0
        if self.train_dataset is not None:
            # The train loader first: DeepSpeed's engine needs the micro-batch size at setup.
            self._train_loader = runner.setup_dataloader(self.get_train_dataloader())
            try:
                self._per_epoch = steps_per_epoch(len(self._train_loader), args.gradient_accumulation_steps)
            except TypeError:  # a stream: max_steps bounds the run, and each pass over the stream is an epoch
                self._per_epoch = None
            max_steps, self._num_epochs = total_steps(args, self._per_epoch)
            if self._per_epoch is None:
                self._per_epoch, self._num_epochs = max_steps, sys.maxsize
        self._max_steps = max_steps
        model = maybe_compile(self._user_model, args)  # in place, the last change before setup
        if self.train_dataset is not None or self.optimizer is not None:
            optimizer = self.optimizer or create_optimizer(model, args, self._engine_spec)
            self._backward_stepper = backward_stepper(optimizer, runner, args)  # LOMO, AdaLomo, layer-wise
            check_optimizer_strategy(optimizer, runner.strategy)
            scheduler = self.lr_scheduler or create_scheduler(optimizer, args, self._engine_spec, max(max_steps, 1))
            self._plateau = isinstance(scheduler, ReduceLROnPlateau)
            if self._plateau:  # stepped on an eval metric by the Trainer, not per step by the Runner
                self.model, self.optimizer = runner.setup(model, optimizer)
            else:
                self.model, self.optimizer, scheduler = runner.setup(model, optimizer, scheduler)
            self.lr_scheduler = scheduler
            if self._backward_stepper is not None:  # under DDP: the hooks average gradients, not DDP
                self._backward_stepper.setup(self.model)
        else:
            self._plateau = False
            self.model = runner.setup(model)
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        handler.train_dataloader = self._train_loader
        self._setup_done = True

    def add_callback(self, callback) -> None:
        """Add a TrainerCallback (instance or class)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove and return a callback (instance, or the first of a class)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        """Remove a callback (instance, or the first of a class)."""
        self.callback_handler.remove_callback(callback)

    # ---- training ---------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: bool | str | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Train for ``max_steps`` (or ``num_train_epochs``); resume from a checkpoint (True: the newest in
        ``output_dir``) with the data position, RNG, schedule, loss trace and callback state restored."""
        if kwargs:
            raise TypeError(f"train() got unexpected arguments {sorted(kwargs)}")
        args = self.args
        if resume_from_checkpoint is None and args.resume_from_checkpoint:
            resume_from_checkpoint = args.resume_from_checkpoint
        if self.train_dataset is None:
            raise ValueError("train() needs Trainer(train_dataset=...)")
        self._ensure_setup()
        path = self._resolve_resume(resume_from_checkpoint)
        self._new_state()
        if path is not None:
            self._load_checkpoint(path)
            self._refresh_state_limits()
        self._ignore_keys_for_eval = ignore_keys_for_eval
        previous = self._install_signal_handler()
        try:
            with neftune(self.model, args.neftune_noise_alpha, self.runner.unwrap_model):
                return self._train_loop(resumed=path is not None)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _new_state(self) -> None:
        self.state = TrainerState(is_world_process_zero=self.runner.is_main_process,
                                  is_local_process_zero=self.runner.local_rank == 0, epoch=0.0)
        self._refresh_state_limits()

    def _refresh_state_limits(self) -> None:
        args, state, steps = self.args, self.state, self._max_steps
        state.max_steps, state.num_train_epochs = steps, self._num_epochs
        state.logging_steps = args.steps_of("logging_steps", steps)
        state.save_steps = args.steps_of("save_steps", steps)
        state.eval_steps = args.steps_of("eval_steps", steps) if args.eval_steps is not None else state.logging_steps
        state.train_batch_size = args.per_device_train_batch_size
        state.is_world_process_zero = self.runner.is_main_process
        state.is_local_process_zero = self.runner.local_rank == 0

    def _train_loop(self, resumed: bool) -> TrainOutput:
        args, state, loader = self.args, self.state, self._train_loader
        start = time.perf_counter()
        self._train_start = time.monotonic()
        self._last_log_time = start
        self.control._new_training()
        self.control = self.callback_handler.on_train_begin(args, state, self.control)
        if args.eval_on_start and not resumed:
            self._evaluate_and_track()
        first_epoch, steps_at_start = loader.epoch, state.global_step
        for epoch in range(first_epoch, self._num_epochs):
            if state.global_step >= state.max_steps or self.control.should_training_stop:
                break
            self._run_epoch(epoch)
            if self.control.should_training_stop:
                break
        to_eval(self)  # schedule-free: the averaged weights are the trained model (before the best is loaded)
        if args.load_best_model_at_end:
            self._load_best_model()
        return self._finish(start, state.global_step - steps_at_start)

    def _run_epoch(self, epoch: int) -> None:
        args, state, loader, ga = self.args, self.state, self._train_loader, self.args.gradient_accumulation_steps
        loader.set_epoch(epoch)
        step_in_epoch = loader.batches_seen // ga
        self.control._new_epoch()
        self.control = self.callback_handler.on_epoch_begin(args, state, self.control)
        batches = iter(loader)
        while state.global_step < state.max_steps:
            window = list(itertools.islice(batches, ga))
            if len(window) < ga:
                self._warn_tail(len(window))
                break
            self._train_window(window)
            step_in_epoch += 1
            state.global_step += 1
            state.epoch = epoch + step_in_epoch / self._per_epoch
            self.control = self.callback_handler.on_step_end(args, state, self.control)
            self._check_stop_request()
            self._maybe_log_save_evaluate()
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_epoch_end(args, state, self.control)
        self._maybe_log_save_evaluate()

    def _warn_tail(self, count: int) -> None:
        if count and not getattr(self, "_tail_warned", False):
            self._tail_warned = True
            logger.warning("each epoch ends with %d micro-batch(es) short of a full accumulation window of %d; they "
                           "are not trained on. Make batches per epoch a multiple of gradient_accumulation_steps",
                           count, self.args.gradient_accumulation_steps)

    def _train_window(self, window: list[Any]) -> None:
        args, runner = self.args, self.runner
        self.control._new_step()
        to_train(self)  # schedule-free: gradients at y (a save or an evaluation swapped the average x in)
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        num_items = self._count_window(window)
        window_loss = None
        for index, inputs in enumerate(window):
            loss = self.training_step(self.model, inputs, num_items)
            window_loss = loss if window_loss is None else window_loss + loss
            if index < len(window) - 1:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
        self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
        self._grad_norm = runner.clip_gradients(args.max_grad_norm) if args.max_grad_norm > 0 else None
        pass_training_loss(self, window_loss)  # GrokAdamW's step reads it
        if self._backward_stepper is None:
            runner.step()
        else:  # LOMO, AdaLomo, layer-wise: the weights moved in backward; the schedule steps here
            self._grad_norm = self._backward_stepper.finish_step(None if self._plateau else self.lr_scheduler)
        self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
        self._pending_local.append(window_loss.float())

    def _dp_size(self) -> int:
        return getattr(self.runner.strategy, "data_parallel_size", self.runner.world_size)

    def _count_window(self, window: list[Any]) -> torch.Tensor:
        """Label items of the whole window: this rank's micro-batches, summed over ranks (one all-reduce)."""
        label = self.label_names[0]
        local = sum(count_label_items(b.get(label) if isinstance(b, Mapping) else None, self._shift_labels)
                    for b in window)
        tokens = sum(_tokens_of(b) for b in window)
        self._counts_local += torch.tensor([tokens, sum(_rows_of(b) for b in window)], dtype=torch.float64)
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
        return self.args.gradient_accumulation_steps * ranks

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | None = None):
        """Forward and backward of one micro-batch; returns its detached share of the window's loss."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        if self._compute_loss_takes_items:
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        else:  # an override with HF's old signature returns a micro-batch mean
            loss = self.compute_loss(model, inputs) / self._backward_scale
        stepper = self._backward_stepper  # LOMO/AdaLomo: fused_backward replaces the Runner's backward
        (stepper.backward if stepper is not None else self.runner.backward)(loss * self._backward_scale)
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

    # ---- logging, evaluation and saving between steps -----------------------------------------------

    def _maybe_log_save_evaluate(self) -> None:
        control, args = self.control, self.args
        if control.should_log:
            self._log_training()
            control.should_log = False
        new_best = False
        if control.should_evaluate:
            new_best = self._evaluate_and_track()
            control.should_evaluate = False
        if args.save_strategy == "best" and new_best:
            control.should_save = True
        if control.should_save and not args.fast_dev_run:
            self._save_checkpoint()
        self.control.should_save = False

    def _evaluate_and_track(self) -> bool:
        if self.eval_dataset is None:
            raise ValueError(f"eval_strategy={self.args.eval_strategy!r} needs Trainer(eval_dataset=...)")
        metrics = self.evaluate(ignore_keys=getattr(self, "_ignore_keys_for_eval", None))
        pass_eval_loss(self, metrics)
        new_best = self._update_best(metrics)
        if self._plateau:
            self.lr_scheduler.step(metrics[self._metric_key(metrics)])
        return new_best

    def _metric_key(self, metrics: dict[str, float]) -> str:
        name = self.args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"metric_for_best_model={name!r}: the evaluation returned no {key!r}; it returned "
                           f"{sorted(metrics)}. Set metric_for_best_model to one of them (without 'eval_')")
        return key

    def _update_best(self, metrics: dict[str, float]) -> bool:
        if self.args.metric_for_best_model is None:
            return False
        value, best = metrics[self._metric_key(metrics)], self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better:
            self.state.best_metric, self.state.best_global_step = value, self.state.global_step
        return better

    def _gather_pending_losses(self) -> list[float]:
        """Every step's global loss since the last log (one all-reduce of the not-yet-gathered steps)."""
        if self._pending_local:
            stacked = torch.stack(self._pending_local).to(torch.float64)
            if self.args.average_tokens_across_devices:
                stacked = self.runner.all_reduce(stacked, "sum")
            else:
                stacked = self.runner.all_reduce(stacked, "mean") / self.args.gradient_accumulation_steps
            self._pending_global.extend(stacked.cpu().tolist())
            self._pending_local = []
        return list(self._pending_global)

    def _log_training(self) -> None:
        losses = self._gather_pending_losses()
        finite = [v for v in losses if math.isfinite(v)]
        if len(finite) < len(losses) and self.args.logging_nan_inf_filter:
            logger.warning("%d of the last %d steps had a NaN/inf loss; left out of the logged loss",
                           len(losses) - len(finite), len(losses))
        else:
            finite = losses
        self._loss_total[0] += sum(finite)
        self._loss_total[1] += len(finite)
        self._pending_global = []
        counts = self.runner.all_reduce(self._counts_local.to(self.runner.device), "sum").cpu()
        self._counts_local = torch.zeros(2, dtype=torch.float64)
        now = time.perf_counter()
        elapsed, self._last_log_time = max(now - self._last_log_time, 1e-9), now
        self.state.num_input_tokens_seen += int(counts[0])
        logs: dict[str, float] = {"loss": round(sum(finite) / len(finite), 6) if finite else float("nan")}
        if self._grad_norm is not None:
            logs["grad_norm"] = float(self._grad_norm)
        logs["learning_rate"] = self._current_lr()
        logs["tokens_per_second"] = round(float(counts[0]) / elapsed, 3)
        logs["samples_per_second"] = round(float(counts[1]) / elapsed, 3)
        self.log(logs)

    def _current_lr(self) -> float:
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "get_last_lr") and not self._plateau:
            return float(self.lr_scheduler.get_last_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``epoch``, record in ``state.log_history`` and call ``on_log``."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": round(self.state.epoch, 4)}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs=logs)

    def _finish(self, start: float, steps: int) -> TrainOutput:
        losses = self._gather_pending_losses()
        finite = [v for v in losses if math.isfinite(v)]
        total, count = self._loss_total[0] + sum(finite), self._loss_total[1] + len(finite)
        self._pending_global = []
        runtime = time.perf_counter() - start
        batch = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self._dp_size()
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(steps * batch / max(runtime, 1e-9), 3),
                   "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
                   "total_flos": 0.0, "train_loss": total / count if count else float("nan")}
        self.log(dict(metrics))
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    # ---- preemption and wall-clock budget -----------------------------------------------------------

    def _install_signal_handler(self):
        self._stop_signal.clear()
        if not self.args.save_on_sigterm or threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGTERM, lambda signum, frame: self._stop_signal.set())

    def _check_stop_request(self) -> None:
        """On SIGTERM (any rank) or past max_time (rank 0's clock): save now and stop, on every rank together."""
        args = self.args
        if not args.save_on_sigterm and args.max_time is None:
            return
        over_time = args.max_time is not None and time.monotonic() - self._train_start > args.max_time
        flags = torch.tensor([float(self._stop_signal.is_set()), float(over_time and self.runner.is_main_process)])
        flags = self.runner.all_reduce(flags.to(self.runner.device), "max").cpu()
        if flags.any():
            reason = "SIGTERM" if flags[0] else f"max_time={args.max_time}s"
            logger.warning("%s: saving checkpoint-%d and stopping", reason, self.state.global_step)
            self.control.should_training_stop = True
            self.control.should_save = True

    # ---- saving the model ----------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, merge_adapters: bool = False) -> None:
        """Save the full model (gathered from shards) for inference: HF ``save_pretrained`` format for
        PreTrainedModels, else ``model.safetensors``; plus the processing_class when it can save itself.

        A peft ``PeftModel`` (LoRA) saves its adapters only (``adapter_model.safetensors`` + ``adapter_config.json``,
        for ``PeftModel.from_pretrained``); ``merge_adapters=True`` writes the base model with the adapters merged
        in, in HF format (``from_pretrained`` loads it without peft)."""
        from shardkit.trainer.export import save_full_model

        self._ensure_setup()
        to_eval(self)  # schedule-free: export the averaged weights
        output_dir = output_dir or self.args.output_dir
        if is_peft_model(self.runner.unwrap_model(self.model)):
            save_peft_model(self.runner, self.model, output_dir, merge_adapters, self.processing_class, self.args)
            return
        if merge_adapters:
            raise ValueError(f"save_model(merge_adapters=True) merges LoRA adapters into the base model, but the model "
                             f"is a {type(self.runner.unwrap_model(self.model)).__name__}, not a peft PeftModel")
        save_full_model(self.runner, self.model, output_dir, self.processing_class, self.args)


def _tokens_of(batch: Any) -> int:
    if not isinstance(batch, Mapping):
        return 0
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    ids = batch.get("input_ids")
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


def _rows_of(batch: Any) -> int:
    if isinstance(batch, Mapping):
        first = next(iter(batch.values()), None)
        return first.shape[0] if isinstance(first, torch.Tensor) and first.ndim else 1
    return 1
