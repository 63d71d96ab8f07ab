"""Callbacks: Hugging Face's events, the default flow (when to log, evaluate and save), progress, early stopping."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from shardkit.trainer.state import ExportableState, TrainerControl, TrainerState
from shardkit.utils.suggest import did_you_mean

__all__ = ["TrainerCallback", "CallbackHandler", "DefaultFlowCallback", "ProgressCallback", "PrinterCallback",
           "EarlyStoppingCallback", "ExportableState", "EVENTS"]

logger = logging.getLogger("shardkit.trainer")

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict",
          "on_save", "on_log", "on_prediction_step", "on_push_begin")


class TrainerCallback:
    """Base class: override the events you need. Each gets ``(args, state, control, **kwargs)`` where kwargs
    hold ``model``, ``processing_class``, ``optimizer``, ``lr_scheduler``, ``train_dataloader``,
    ``eval_dataloader`` and event-specific values (``metrics``, ``logs``). Return a TrainerControl (or None)."""

    def on_init_end(self, args, state, control, **kwargs): pass
    def on_train_begin(self, args, state, control, **kwargs): pass
    def on_train_end(self, args, state, control, **kwargs): pass
    def on_epoch_begin(self, args, state, control, **kwargs): pass
    def on_epoch_end(self, args, state, control, **kwargs): pass
    def on_step_begin(self, args, state, control, **kwargs): pass
    def on_pre_optimizer_step(self, args, state, control, **kwargs): pass
    def on_optimizer_step(self, args, state, control, **kwargs): pass
    def on_substep_end(self, args, state, control, **kwargs): pass
    def on_step_end(self, args, state, control, **kwargs): pass
    def on_evaluate(self, args, state, control, **kwargs): pass
    def on_predict(self, args, state, control, metrics, **kwargs): pass
    def on_save(self, args, state, control, **kwargs): pass
    def on_log(self, args, state, control, logs=None, **kwargs): pass
    def on_prediction_step(self, args, state, control, **kwargs): pass
    def on_push_begin(self, args, state, control, **kwargs): pass


class CallbackHandler(TrainerCallback):
    """Calls every callback in order for each event; a callback's returned control replaces the current one."""

    def __init__(self, callbacks, model, processing_class, optimizer, lr_scheduler):
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks:
            self.add_callback(cb)
        self.model, self.processing_class = model, processing_class
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None
        if not any(isinstance(cb, DefaultFlowCallback) for cb in self.callbacks):
            logger.warning(f"the Trainer has no DefaultFlowCallback, so nothing decides when to log, evaluate or "
                           f"save: add one with trainer.add_callback(DefaultFlowCallback). Its callbacks are:\n"
                           f"{self.callback_list}")

    @property
    def callback_list(self) -> str:
        """The callbacks' class names, one per line."""
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def add_callback(self, callback) -> None:
        cb = callback() if isinstance(callback, type) else callback
        cls = type(cb)
        if any(type(c) is cls for c in self.callbacks):
            # Formatted here (not by the logger): the message must name the class wherever it is read.
            logger.warning(f"adding callback {cls.__name__} that is already present; the callbacks are now "
                           f"{[type(c).__name__ for c in self.callbacks] + [cls.__name__]}")
        self.callbacks.append(cb)

    def pop_callback(self, callback):
        for cb in self.callbacks:
            if (isinstance(callback, type) and type(cb) is callback) or cb is callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback) -> None:
        self.pop_callback(callback)

    def call_event(self, event: str, args, state: TrainerState, control: TrainerControl, **kwargs) -> TrainerControl:
        for cb in self.callbacks:
            result = getattr(cb, event)(
                args, state, control, model=self.model, processing_class=self.processing_class,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader, **kwargs,
            )
            if isinstance(result, Mapping):  # {"should_training_stop": True}: flags to set (the Trainer docs' form)
                _apply_flags(control, result, type(cb).__name__, event)
            elif result is not None:
                control = result
        return control



def _apply_flags(control: TrainerControl, flags: Mapping[str, Any], owner: str, event: str) -> None:
    valid = [f.name for f in dataclasses.fields(TrainerControl)]
    for key, value in flags.items():
        if key not in valid:
            raise ValueError(f"{owner}.{event} returned {{{key!r}: ...}}: not a TrainerControl flag"
                             f"{did_you_mean(str(key), valid)} Flags: {valid}")
        setattr(control, key, bool(value))


def _router(name: str):
    def route(self, args, state, control, **kwargs):
        return self.call_event(name, args, state, control, **kwargs)

    route.__name__ = name
    return route


# CallbackHandler inherits TrainerCallback's no-op events; each of its events calls every callback instead.
for _event in EVENTS:
    setattr(CallbackHandler, _event, _router(_event))


class DefaultFlowCallback(TrainerCallback):
    """Sets should_log / should_evaluate / should_save from the logging, eval and save strategies."""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and step % state.eval_steps == 0 and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            # The last step is evaluated (unless it just was) and saved, whatever eval_steps/save_steps say.
            if args.eval_strategy == "steps" and step % state.eval_steps and args.eval_delay <= step:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= (state.epoch or 0):
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class ProgressCallback(TrainerCallback):
    """A tqdm bar of optimizer steps on the main process; eval bars below it."""

    def __init__(self):
        self.bar = None
        self.eval_bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and eval_dataloader is not None:
            if self.eval_bar is None:
                from tqdm.auto import tqdm

                self.eval_bar = tqdm(total=len(eval_dataloader), leave=self.bar is None, dynamic_ncols=True)
            self.eval_bar.update(1)

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_eval()

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self._close_eval()

    def _close_eval(self):
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs:
            shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}
            self.bar.set_postfix(shown, refresh=False)
            self.bar.write(str(shown))

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PrinterCallback(TrainerCallback):
    """Prints each log dict on the main process (used instead of the bar when disable_tqdm=True)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print({k: v for k, v in logs.items() if k != "total_flos"})


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stop when ``metric_for_best_model`` has not improved (by more than ``threshold``) for ``patience``
    evaluations in a row. Its counter is saved in checkpoints and restored on resume.

    Args:
        early_stopping_patience: evaluations without improvement before stopping.
        early_stopping_threshold: how much better than the best a value must be to count as improving.
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0):
        if early_stopping_patience < 1:
            raise ValueError(f"early_stopping_patience={early_stopping_patience} must be >= 1")
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        self.early_stopping_patience_counter = 0

    def check_metric_value(self, args, state, control, metric_value: float) -> None:
        """Count ``metric_value`` against ``state.best_metric`` (the best before this evaluation)."""
        best = state.best_metric
        better = best is None or (metric_value > best if args.greater_is_better else metric_value < best)
        if better and (best is None or abs(metric_value - best) > self.early_stopping_threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs TrainingArguments.metric_for_best_model (e.g. 'loss')")
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs evaluations: set eval_strategy to 'steps' or 'epoch'")
        if not args.load_best_model_at_end:
            logger.warning("EarlyStoppingCallback without load_best_model_at_end=True: when training stops, the "
                           "last weights are kept, not the best ones")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None:
            logger.warning(f"early stopping: metric {key!r} is not in the evaluation's metrics "
                           f"{sorted(metrics or {})}; this evaluation is not counted")
            return
        # The Trainer updates state.best_metric after on_evaluate, so it still holds the previous best here.
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict[str, Any]:
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter}}
