"""report_to: a JSON-lines file per run, TensorBoard event files (needs the `tensorboard` package), and every other
tracker of :data:`shardkit.tracking.TRACKERS` (``wandb``, ``mlflow``, ``csv``) through :class:`TrackerCallback`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from shardkit.trainer.callbacks import TrainerCallback

__all__ = ["JsonlCallback", "TensorBoardCallback", "TrackerCallback", "reporter_callbacks"]


def _scalars(logs: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class JsonlCallback(TrainerCallback):
    """Appends each log (with step and wall time) as one JSON line to ``<logging_dir>/<run_name>.jsonl``."""

    def __init__(self):
        self.path: Path | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._open(args, state)

    def _open(self, args, state) -> None:
        if self.path is None and state.is_world_process_zero:
            name = str(args.run_name).replace("/", "_").strip("_") or "run"
            self.path = Path(args.logging_dir) / f"{name}.jsonl"
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._open(args, state)
        if self.path is None or not logs:
            return
        record = {"step": state.global_step, "time": time.time(), **logs}
        # JSON has no NaN: non-finite values are written as strings so the file stays valid JSON.
        record = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, default=str) + "\n")


class TensorBoardCallback(TrainerCallback):
    """Writes each log's numbers as TensorBoard scalars under ``logging_dir`` (main process only)."""

    def __init__(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer imports the tensorboard package
            raise ImportError("report_to='tensorboard' needs the `tensorboard` package: "
                              "pip install tensorboard") from err
        self._writer_cls = SummaryWriter
        self.writer = None

    def _open(self, args, state) -> None:
        if self.writer is None and state.is_world_process_zero:
            self.writer = self._writer_cls(log_dir=args.logging_dir)
            self.writer.add_text("args", args.to_json_string())

    def on_train_begin(self, args, state, control, **kwargs):
        self._open(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._open(args, state)
        if self.writer is None or not logs:
            return
        for key, value in _scalars(logs).items():
            tag = key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}"
            self.writer.add_scalar(tag, value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class TrackerCallback(TrainerCallback):
    """A tracker of :data:`shardkit.tracking.TRACKERS` on the main process: the arguments as its hyperparameters once,
    each log's values at ``global_step`` (``run_name`` is the W&B project / MLflow experiment; files under
    ``logging_dir``)."""

    def __init__(self, name: str):
        self.name = name
        self.tracker: Any = None

    def _open(self, args, state) -> None:
        if self.tracker is None and state.is_world_process_zero:
            from shardkit.tracking import build_trackers

            name = str(args.run_name).replace("/", "_").strip("_") or "run"
            self.tracker = build_trackers(self.name, name, args.logging_dir)[0]
            self.tracker.store_init_configuration(json.loads(args.to_json_string()))

    def on_train_begin(self, args, state, control, **kwargs):
        self._open(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._open(args, state)
        if self.tracker is not None and logs:
            self.tracker.log(dict(logs), step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.finish()
            self.tracker = None


def reporter_callbacks(report_to: list[str]) -> list[TrainerCallback]:
    table = {"jsonl": JsonlCallback, "tensorboard": TensorBoardCallback}
    return [table[name]() if name in table else TrackerCallback(name) for name in report_to]
