"""report_to: reporters by name, through one registry: a JSON-lines file per run, TensorBoard event files.

``TrainingArguments(report_to=...)`` names reporters registered here; the Trainer adds one callback per name
(:func:`reporter_callbacks`). Another tracker plugs in with :func:`register_reporter` (a TrainerCallback
class or factory, and whether its package is installed, for ``report_to="all"``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardkit.trainer.callbacks import TrainerCallback

__all__ = ["JsonlCallback", "TensorBoardCallback", "available_reporters", "register_reporter", "reporter_callbacks",
           "reporter_names"]


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


_REPORTERS: dict[str, tuple[Callable[[], TrainerCallback], Callable[[], bool]]] = {}


def register_reporter(name: str, factory: Callable[[], TrainerCallback], available: Callable[[], bool] = lambda: True,
                      *, overwrite: bool = False) -> None:
    """Make ``report_to=name`` add ``factory()`` to the Trainer's callbacks; ``available()`` says whether its
    package is installed (``report_to="all"`` takes the available ones). The factory may raise ImportError
    naming the package to install, at Trainer construction."""
    if name in _REPORTERS and not overwrite:
        raise ValueError(f"reporter {name!r} is already registered; pass overwrite=True to replace it")
    _REPORTERS[name] = (factory, available)


def reporter_names() -> list[str]:
    """Every registered reporter name, plus "none" and "all"."""
    return sorted([*_REPORTERS, "none", "all"])


def available_reporters() -> list[str]:
    """The registered reporters whose packages are installed (what ``report_to="all"`` means)."""
    return sorted(name for name, (_, available) in _REPORTERS.items() if available())


def reporter_callbacks(report_to: list[str]) -> list[TrainerCallback]:
    """One callback per name in ``report_to`` (names checked by TrainingArguments)."""
    return [_REPORTERS[name][0]() for name in report_to]


register_reporter("jsonl", JsonlCallback)
register_reporter("tensorboard", TensorBoardCallback, lambda: importlib.util.find_spec("tensorboard") is not None)
