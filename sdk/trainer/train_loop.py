"""The training loop: epochs of accumulation windows, and logging, evaluation and saving between steps.

Steps are counted as Hugging Face counts them: an epoch of ``B`` batches takes ``ceil(B / accumulation)``
optimizer steps, the last window holding the remainder (``Runner.begin_window``), and an epoch shorter than a
window still takes one step. The loss of each step is exact over its window and ranks; logs carry no timing,
so a resumed run's ``log_history`` equals the uninterrupted run's (tokens/s, TFLOP/s and MFU go to the reporters
only: :mod:`~shardkit.trainer.step_rates`). ``auto_find_batch_size`` retries the run
with 90% of the batch (as Hugging Face does) when a step runs out of memory.

:class:`TrainLoop` is the loop: it owns what a run keeps between steps (the step rates, the gradient norm and
learning rate to log, the last step logged) and is handed the Trainer, whose overridable methods it calls
(``training_step``, ``get_batch_samples``, ``log``, ``evaluate``, ``_save_checkpoint`` ...). The mixin holds
Hugging Face's method names of the loop (``train``, ``log``, ``_maybe_log_save_evaluate`` ...) on the Trainer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from shardkit.models.moe import update_router_biases
from shardkit.trainer import hub
from shardkit.trainer.callbacks import ExportableState
from shardkit.trainer.engine import steps_per_epoch, total_steps
from shardkit.trainer.neftune import neftune
from shardkit.trainer.optim_modes import pass_eval_loss, pass_training_loss, to_eval, to_train
from shardkit.trainer.state import TrainerControl, TrainerState
from shardkit.trainer.step_rates import StepRates
from shardkit.trainer.training_step import InputCounter

__all__ = ["TrainLoop", "TrainLoopMixin", "TrainOutput", "is_out_of_memory"]

logger = logging.getLogger("shardkit.trainer")

_OOM_TEXT = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_SUPPORTED", "can't allocate memory",
             "DefaultCPUAllocator: not enough memory")


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a device or host allocation failure (what ``auto_find_batch_size`` retries)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and len(err.args) == 1 and any(t in str(err.args[0]) for t in _OOM_TEXT)


class TrainLoopMixin:
    """train(), log() and Hugging Face's loop methods on the Trainer; the loop is :attr:`loop` (a TrainLoop)."""

    def train(self, resume_from_checkpoint: bool | str | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Train for ``max_steps`` (or ``num_train_epochs``); resume from a checkpoint (True: the newest in
        ``output_dir``; shardkit's or one Hugging Face's Trainer wrote) with the data position, RNG, schedule,
        loss trace and callback state restored."""
        if kwargs:
            raise TypeError(f"train() got unexpected arguments {sorted(kwargs)}")
        if trial is not None:
            raise NotImplementedError("train(trial=...) is for hyperparameter_search, which shardkit's Trainer does "
                                      "not have: run the search loop yourself around Trainer(model_init=...)")
        if self.train_dataset is None:
            raise ValueError("train() needs Trainer(train_dataset=...)")
        if resume_from_checkpoint is None and self.args.resume_from_checkpoint:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        return self.loop.train(resume_from_checkpoint, ignore_keys_for_eval)

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple[int, int, int, int, int, int, int]:
        """(epochs, update steps per epoch, examples, training samples, total batch size, batches per epoch,
        max steps), as Hugging Face computes them."""
        per_epoch = steps_per_epoch(len(dataloader), args.gradient_accumulation_steps)
        max_steps, epochs = total_steps(args, per_epoch)
        examples = self.num_examples(dataloader)
        batch = self.get_total_train_batch_size(args)
        samples = max_steps * batch if args.max_steps > 0 else examples * args.num_train_epochs
        return epochs, per_epoch, examples, samples, batch, len(dataloader), max_steps

    def _get_output_dir(self, trial: Any = None) -> str:
        return self.args.output_dir

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``epoch`` (and ``num_input_tokens_seen``) to ``logs``, record them in ``state.log_history`` with
        the step, and call ``on_log`` (with the training log's tokens/s, TFLOP/s and MFU, which ``log_history``
        leaves out)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        rates = self.loop.take_rates()
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs={**logs, **rates})

    def _maybe_log_save_evaluate(self) -> None:
        self.loop.log_save_evaluate()

    def _evaluate(self, trial: Any, ignore_keys: list[str] | None, skip_scheduler: bool = False) -> dict[str, float]:
        """evaluate(), then a metric-driven scheduler (ReduceLROnPlateau, GreedyLR) steps on the metric."""
        metrics = self.evaluate(ignore_keys=ignore_keys)
        pass_eval_loss(self, metrics)
        if self.prepared.metric_scheduler and not skip_scheduler:
            self.lr_scheduler.step(metrics[metric_key(self.args, metrics)])
        return metrics

    def _determine_best_metric(self, metrics: dict[str, float]) -> bool:
        """Record a new best ``metric_for_best_model``; True when this evaluation set one."""
        if self.args.metric_for_best_model is None:
            return False
        value, best = metrics[metric_key(self.args, metrics)], self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better:
            self.state.best_metric = float(value)
            if self.args.save_strategy in ("steps", "epoch", "best"):
                self.state.best_global_step = self.state.global_step
        return better

    def _save_checkpoint(self, model: Any = None, trial: Any = None) -> Any:
        """Save ``checkpoint-<global_step>`` (exact-resume state and Hugging Face's files), then rotate."""
        to_eval(self)  # schedule-free: the checkpoint holds the averaged weights (training swaps back)
        self.loop.flush_counts()
        self.store_flos()
        path = self.checkpointer.save(self.checkpoint_parts())  # complete on every rank (barrier) before any upload
        if self.args.push_to_hub:
            self.runner.wait_for_save()  # async_save: the upload needs the published checkpoint
        hub.push_checkpoint(self, path)
        return path

    def load_model(self, path: Any) -> None:
        """Load only the model weights of a checkpoint (shardkit's at any world size, or Hugging Face's)."""
        self.ensure_setup()
        self.checkpointer.load_model(path, self.model_wrapped)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None:
            logger.warning("load_best_model_at_end: no best checkpoint was saved; keeping the last weights")
            return
        if self.runner.is_main_process:
            logger.info(f"loading the best model from {best} ({self.args.metric_for_best_model}="
                        f"{self.state.best_metric})")
        self.load_model(best)


def metric_key(args: Any, metrics: dict[str, float]) -> str:
    """The key of ``metric_for_best_model`` in evaluation metrics (``eval_`` added), refused by name if absent."""
    name = args.metric_for_best_model or "loss"
    key = name if name.startswith("eval_") else f"eval_{name}"
    if key not in metrics:
        raise KeyError(f"The `metric_for_best_model` training argument is set to {key!r}, which is not found in "
                       f"the evaluation metrics. The available evaluation metrics are: {list(metrics)}. Set "
                       "metric_for_best_model to one of them (without 'eval_')")
    return key


class TrainLoop:
    """One Trainer's training runs: the epochs, the accumulation windows and what happens between steps.

    It owns what a run keeps between steps and hands the Trainer's overridable methods their part: the Trainer
    holds one (``trainer.loop``) from its construction, so ``log()`` called outside train() finds no rates.
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.counter = InputCounter(trainer.runner)
        self.rates: StepRates | None = None
        self.pending_rates: dict[str, float] = {}  # the last training log's tokens/s, TFLOP/s, MFU for on_log
        self.grad_norm: Any = None
        self.step_lr: float | None = None  # the rate the last step used (Hugging Face logs it)
        self.last_logged_step = 0
        self.ignore_keys_for_eval: list[str] | None = None

    def take_rates(self) -> dict[str, float]:
        rates, self.pending_rates = self.pending_rates, {}
        return rates

    # ---- train() and its retries ---------------------------------------------------------------------

    def train(self, resume: Any, ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        trainer, args = self.trainer, self.trainer.args
        trainer.memory_tracker.start("train")
        if trainer.model_init is not None:
            self._reinit_model()
        trainer.is_in_train = True
        try:
            while True:
                retry = args.auto_find_batch_size and trainer._train_batch_size > 1
                try:  # an OOM this loop recovers from gets no report; the last one, at batch 1, does
                    with trainer.runner.retrying_oom() if retry else contextlib.nullcontext():
                        return self._train_once(resume, ignore_keys_for_eval)
                except Exception as err:  # noqa: BLE001 - only out-of-memory is retried, the rest re-raised
                    if not (args.auto_find_batch_size and is_out_of_memory(err)) or trainer._train_batch_size <= 1:
                        raise
                    self._shrink_batch(err)
        finally:
            trainer.is_in_train = False
            trainer.stop_requests.stop()

    def _reinit_model(self) -> None:
        """``model_init``: each train() starts from a fresh model seeded with ``args.seed`` (as HF does)."""
        from shardkit.utils.seeding import seed_everything

        trainer = self.trainer
        seed_everything(trainer.args.seed)
        trainer.set_model(trainer.call_model_init())
        trainer.optimizer = trainer.lr_scheduler = None
        trainer.prepared.done = False
        # The data order follows the seed too (data_seed, else seed), which a script may have changed.
        trainer.runner.seed = trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed

    def _shrink_batch(self, err: BaseException) -> None:
        trainer = self.trainer
        new = max(int(trainer._train_batch_size * 0.9), 1)
        logger.warning(f"auto_find_batch_size: out of memory at per-device batch {trainer._train_batch_size} "
                       f"({str(err)[:80]}); retrying with {new}")
        trainer._train_batch_size = new
        if trainer.prepared.done:
            trainer.runner.abandon_window()  # the failed window's gradients go; the retry starts a window afresh
        trainer.refresh_train_loader()
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _train_once(self, resume: Any, ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        trainer = self.trainer
        trainer.ensure_setup()
        config = getattr(trainer.model, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = trainer.args.use_cache
        path = trainer.checkpointer.resolve(resume)
        if path is not None and trainer.args.auto_find_batch_size:
            self._resume_batch_size(path)
        self._new_state()
        if path is not None:
            self._resume(path)
        self.ignore_keys_for_eval = ignore_keys_for_eval
        trainer.stop_requests.start()
        with neftune(trainer.model_wrapped, trainer.args.neftune_noise_alpha, trainer.runner.unwrap_model):
            return self._run(resumed=path is not None)

    def _resume_batch_size(self, path: Any) -> None:
        """auto_find_batch_size: a resumed run starts from the batch size the checkpoint trained with."""
        from shardkit.trainer.state import TRAINER_STATE_NAME

        saved = TrainerState.load_from_json(path / TRAINER_STATE_NAME).train_batch_size
        if saved is not None and saved != self.trainer._train_batch_size:
            self.trainer._train_batch_size = saved
            self.trainer.refresh_train_loader()

    def _new_state(self) -> None:
        trainer = self.trainer
        max_steps, epochs = self._max_steps_and_epochs()
        trainer.state = TrainerState(is_world_process_zero=trainer.runner.is_main_process,
                                     is_local_process_zero=trainer.runner.local_rank == 0, max_steps=max_steps,
                                     num_train_epochs=epochs, train_batch_size=trainer._train_batch_size)
        trainer.state.compute_steps(trainer.args, max_steps)
        trainer.control = TrainerControl()
        trainer.losses.reset()
        self.last_logged_step = 0
        self.counter.reset()
        trainer.current_flos = 0.0

    def _max_steps_and_epochs(self) -> tuple[int, int]:
        prepared, args = self.trainer.prepared, self.trainer.args
        if prepared.per_epoch is None:  # a stream: each pass over it is an epoch, as many as max_steps needs
            max_steps = total_steps(args, None)[0]
            prepared.per_epoch = max_steps
            return max_steps, sys.maxsize
        return total_steps(args, prepared.per_epoch)

    def _resume(self, path: Any) -> None:
        trainer = self.trainer
        saved, exact = trainer.checkpointer.load(path, trainer.checkpoint_parts())
        max_steps, epochs = trainer.state.max_steps, trainer.state.num_train_epochs
        self._compare_args(saved)
        state = trainer.state = saved
        state.max_steps, state.num_train_epochs = max_steps, epochs
        state.compute_steps(trainer.args, max_steps)
        state.train_batch_size = trainer._train_batch_size
        state.is_world_process_zero = trainer.runner.is_main_process
        state.is_local_process_zero = trainer.runner.local_rank == 0
        self.last_logged_step = state.global_step
        if not exact:
            self._position_from_step()
        self._load_callback_state()
        trainer.control._new_training()  # a run stopped by a callback or a signal resumes to train on
        if trainer.runner.is_main_process:
            logger.info(f"resumed from {path} at step {state.global_step} of {max_steps} (epoch "
                        f"{state.epoch or 0:.4g})")

    def _compare_args(self, saved: TrainerState) -> None:
        """Log the step settings that differ from the checkpoint's (as Hugging Face does)."""
        args = self.trainer.args
        differ = []
        for name in ("logging_steps", "eval_steps", "save_steps", "train_batch_size"):
            mine = args.per_device_train_batch_size if name == "train_batch_size" else getattr(args, name)
            theirs = getattr(saved, name)
            label = "per_device_train_batch_size" if name == "train_batch_size" else name
            if mine is not None and theirs is not None and mine != theirs:
                differ.append(f"\n\t{label}: {mine} (from args) != {theirs} (from trainer_state.json)")
        if differ:
            logger.warning("the training arguments differ from the checkpoint's trainer_state.json:" + "".join(differ))

    def _position_from_step(self) -> None:
        """Where the data resumes when the exact position is not known (a checkpoint Hugging Face's Trainer
        wrote, or another dataset): the epoch and window the step count gives, as Hugging Face resumes. A stream
        has no epochs to count: the batches the run trained are skipped from its start, as Hugging Face skips
        them."""
        trainer = self.trainer
        loader, step, args = trainer.prepared.train_loader, trainer.state.global_step, trainer.args
        per_epoch = trainer.prepared.per_epoch or trainer.state.max_steps or 1
        try:
            length = len(loader)
        except TypeError:  # a stream
            length = None
        state = loader.state_dict()
        if length is None and "stream" not in state:  # a sharded-files loader: its position is per file
            if args.ignore_data_skip:
                return  # the stream starts from its beginning, as asked
            raise ValueError(f"the data position could not be restored exactly, and a {type(loader).__name__} cannot "
                             f"be positioned from the step count ({step}): resume over the dataset the checkpoint "
                             "was written with, or set ignore_data_skip=True to start it from its beginning")
        batches = 0 if args.ignore_data_skip else (step % per_epoch) * args.gradient_accumulation_steps
        state["epoch"] = step // per_epoch
        if length is None:  # consumed items = samples_seen x world size, from the stream's start
            state["batches_seen"] = batches
            state["samples_seen"] = batches * (loader.batch_size or 1)
            state["stream"] = {"state": None, "index": 0}
        else:
            state["batches_seen"] = min(batches, length)
            state["samples_seen"] = min(state["batches_seen"] * (loader.batch_size or 1), state.get("length", 0))
        state["offset"], state["world_size"] = 0, trainer.runner.strategy.data_parallel_size
        loader.load_state_dict(state)

    def _load_callback_state(self) -> None:
        """Restore the stateful callbacks saved in ``state.stateful_callbacks``: their counters always (exact
        resume); with ``restore_callback_states_from_checkpoint=True`` the callbacks are rebuilt from their saved
        arguments and the TrainerControl flags restored too, as Hugging Face does."""
        trainer = self.trainer
        callbacks = trainer.callback_handler.callbacks
        saved = dict(trainer.state.stateful_callbacks or {})
        control = saved.pop("TrainerControl", None)
        rebuild = trainer.args.restore_callback_states_from_checkpoint
        if rebuild and isinstance(control, dict):
            trainer.control = TrainerControl.from_state(control)
        present = {type(cb).__name__ for cb in callbacks}
        missing = [name for name in saved if name not in present]
        if missing:
            logger.warning(f"the checkpoint holds the state of callbacks this Trainer does not have: "
                           f"{', '.join(missing)}; their state is ignored")
        for name, data in saved.items():
            states = data if isinstance(data, list) else [data]
            mine = [cb for cb in callbacks if type(cb).__name__ == name and isinstance(cb, ExportableState)]
            for callback, state in zip(mine, states):
                if rebuild:
                    callbacks[callbacks.index(callback)] = type(callback).from_state(state)
                else:
                    callback.load_state(state)

    # ---- epochs and steps ------------------------------------------------------------------------

    def _log_start(self) -> None:
        trainer = self.trainer
        state, loader = trainer.state, trainer.prepared.train_loader
        logger.info(f"***** Running training *****\n  Num examples = {trainer.num_examples(loader):,}\n  Num epochs = "
                    f"{state.num_train_epochs:,}\n  Instantaneous batch size per device = "
                    f"{trainer._train_batch_size:,}\n  Total train batch size (w. parallel, distributed & "
                    f"accumulation) = {trainer.get_total_train_batch_size():,}\n  Gradient accumulation steps = "
                    f"{trainer.args.gradient_accumulation_steps}\n  Total optimization steps = {state.max_steps:,}\n"
                    f"  Number of trainable parameters = {trainer.get_num_trainable_parameters():,}")

    def _run(self, resumed: bool) -> TrainOutput:
        trainer = self.trainer
        args, state, loader = trainer.args, trainer.state, trainer.prepared.train_loader
        if trainer.runner.is_main_process:
            self._log_start()
        start = time.perf_counter()
        steps_at_start = state.global_step
        self.rates = StepRates(trainer.runner, getattr(trainer.model, "main_input_name", "input_ids"))
        trainer.control = trainer.callback_handler.on_train_begin(args, state, trainer.control)
        if args.eval_on_start and not resumed:
            trainer._evaluate(None, self.ignore_keys_for_eval, skip_scheduler=True)
        for epoch in range(loader.epoch, state.num_train_epochs):
            if state.global_step >= state.max_steps or trainer.control.should_training_stop:
                break
            self._run_epoch(epoch)
            if trainer.control.should_training_stop:
                break
        to_eval(trainer)  # schedule-free: the averaged weights are the trained model (before the best is loaded)
        return self._finish(start, state.global_step - steps_at_start)

    def _run_epoch(self, epoch: int) -> None:
        trainer = self.trainer
        args, state, loader, handler = trainer.args, trainer.state, trainer.prepared.train_loader, \
            trainer.callback_handler
        loader.set_epoch(epoch)
        batches = _length(loader)
        remaining = batches - loader.batches_seen
        # A stream's length is not known: its epoch advances by max_steps' windows, as Hugging Face counts it.
        epoch_batches = batches if batches != sys.maxsize else state.max_steps * args.gradient_accumulation_steps
        trainer.control._new_epoch()
        trainer.control = handler.on_epoch_begin(args, state, trainer.control)
        iterator = iter(loader)
        while state.global_step < state.max_steps and remaining > 0:
            window, num_items = trainer.get_batch_samples(iterator, min(args.gradient_accumulation_steps, remaining),
                                                          trainer.runner.device)
            if not window:
                break
            remaining -= len(window)
            self._train_window(window, num_items)
            state.global_step += 1
            state.epoch = epoch + loader.batches_seen / max(epoch_batches, 1)
            trainer.control = handler.on_step_end(args, state, trainer.control)
            reason = trainer.stop_requests.check()
            if reason is not None:
                logger.warning(f"{reason}: saving checkpoint-{state.global_step} and stopping")
                trainer.control.should_training_stop = trainer.control.should_save = True
            trainer._maybe_log_save_evaluate()
            if args.torch_empty_cache_steps and state.global_step % args.torch_empty_cache_steps == 0:
                _empty_cache()
            if trainer.control.should_epoch_stop or trainer.control.should_training_stop:
                break
        trainer.control = handler.on_epoch_end(args, state, trainer.control)
        trainer._maybe_log_save_evaluate()

    def _train_window(self, window: list[Any], num_items: torch.Tensor) -> None:
        trainer = self.trainer
        args, runner, handler, prepared = trainer.args, trainer.runner, trainer.callback_handler, trainer.prepared
        trainer.control._new_step()
        to_train(trainer)  # schedule-free: gradients at y (a save or an evaluation swapped the average x in)
        trainer.control = handler.on_step_begin(args, trainer.state, trainer.control)
        trainer.loss_settings.window_len = len(window)
        stepper = prepared.backward_stepper
        if stepper is None or stepper.uses_runner_backward:  # LOMO's own backward keeps DDP's sync off for good
            runner.begin_window(len(window))
        window_loss = None
        for index, inputs in enumerate(window):
            loss = trainer.training_step(trainer.model_wrapped, inputs, num_items)
            window_loss = loss if window_loss is None else window_loss + loss
            if index < len(window) - 1:
                trainer.control = handler.on_substep_end(args, trainer.state, trainer.control)
        self._count_inputs(window)
        self.rates.add(window)
        self.grad_norm = runner.clip_gradients(args.max_grad_norm) if args.max_grad_norm > 0 else None
        trainer.control = handler.on_pre_optimizer_step(args, trainer.state, trainer.control)
        pass_training_loss(trainer, window_loss)  # GrokAdamW's step reads it
        self.step_lr = float(trainer.optimizer.param_groups[0]["lr"])  # the rate this step uses (HF logs it)
        if stepper is None:
            stepped = runner.step()
        else:  # LOMO, AdaLomo, layer-wise: the weights moved in backward; the schedule steps here
            self.grad_norm = stepper.finish_step(None if prepared.metric_scheduler else trainer.lr_scheduler)
            stepped = True
        if stepped:
            # MoE layers with bias_update_rate > 0 steer their routing by the load since the last step: summed
            # over the ranks so that every rank's bias moves the same.
            update_router_biases(trainer.model, lambda counts: runner.all_reduce(counts, "sum"))
        trainer.control = handler.on_optimizer_step(args, trainer.state, trainer.control)
        trainer.losses.add(window_loss)

    def _count_inputs(self, window: list[Any]) -> None:
        """Input tokens (``include_num_input_tokens_seen``) and flos of a window, added locally; the tokens reach
        ``state.num_input_tokens_seen`` over all ranks at the next :meth:`flush_counts`."""
        trainer = self.trainer
        mode = trainer.args.include_num_input_tokens_seen
        name = getattr(trainer.model, "main_input_name", "input_ids")
        pad = getattr(trainer.processing_class, "pad_token_id", None)
        for batch in window:
            if not isinstance(batch, Mapping):
                continue
            trainer.current_flos += float(trainer.floating_point_ops(batch))
            self.counter.add(batch, mode, name, pad)

    def flush_counts(self) -> None:
        """Add the tokens counted since the last flush, over every rank, to ``state.num_input_tokens_seen``."""
        self.trainer.state.num_input_tokens_seen += self.counter.flush()

    # ---- between steps -------------------------------------------------------------------------

    def log_save_evaluate(self) -> None:
        """Log, evaluate and save as the callbacks' flags ask after a step or an epoch."""
        trainer = self.trainer
        control = trainer.control
        if control.should_log and trainer.state.global_step > self.last_logged_step:
            self._log_training()
        control.should_log = False
        if self.rates is not None:
            self.rates.pause()  # evaluations and saves are not training time
        if control.should_evaluate:
            metrics = trainer._evaluate(None, self.ignore_keys_for_eval)
            new_best = trainer._determine_best_metric(metrics)
            if trainer.args.save_strategy == "best":
                control.should_save = new_best
            control.should_evaluate = False
        if control.should_save and not trainer.args.fast_dev_run:
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
        trainer.control.should_save = False
        if self.rates is not None:
            self.rates.resume()

    def _log_training(self) -> None:
        trainer = self.trainer
        logs: dict[str, float] = {"loss": round(trainer.losses.log_value(), 6)}
        self.pending_rates = self.rates.take() if self.rates is not None else {}  # after the loss is read: the
        # device has finished the steps
        if self.grad_norm is not None:
            logs["grad_norm"] = float(self.grad_norm)
        logs["learning_rate"] = self.step_lr or float(trainer.optimizer.param_groups[0]["lr"])
        self.last_logged_step = trainer.state.global_step
        self.flush_counts()
        trainer.store_flos()
        trainer.log(logs)

    def _finish(self, start: float, steps: int) -> TrainOutput:
        trainer = self.trainer
        trainer.runner.wait_for_save()  # async_save: the last checkpoint is published before train() ends
        self.flush_counts()
        trainer.store_flos()
        runtime = time.perf_counter() - start
        samples = steps * trainer.get_total_train_batch_size()
        metrics: dict[str, Any] = {"train_runtime": round(runtime, 4),
                                   "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
                                   "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
                                   "total_flos": trainer.state.total_flos, "train_loss": trainer.losses.train_loss()}
        trainer.memory_tracker.stop("train")
        trainer.memory_tracker.update_metrics("train", metrics)
        trainer.log(metrics)
        if trainer.args.load_best_model_at_end:
            trainer._load_best_model()
        if trainer.runner.is_main_process:
            trainer.checkpointer.keep_only_best(trainer.state.best_model_checkpoint)
        trainer.control = trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
        hub.finish_pushes(trainer)  # as transformers: train() returns once the checkpoint uploads are done
        return TrainOutput(trainer.state.global_step, metrics["train_loss"], metrics)


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _length(loader: Any) -> int:
    """Batches in an epoch of the loader; a stream's are not known ahead (the epoch ends where it does)."""
    try:
        return len(loader)
    except TypeError:
        return sys.maxsize
