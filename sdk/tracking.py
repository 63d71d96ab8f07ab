"""Experiment trackers by name: one registry that every front of shardkit logs through.

    from shardkit.tracking import TRACKERS
    tracker = TRACKERS.build("jsonl", run_name="my_project", logging_dir="runs/logs")
    tracker.store_init_configuration({"lr": 3e-4})
    tracker.log({"loss": 1.25}, step=10)
    tracker.finish()

A tracker is a :class:`Tracker`: built with ``(run_name, logging_dir, **options)``, it keeps hyperparameters
once (:meth:`Tracker.store_init_configuration`) and metrics per step (:meth:`Tracker.log`), and
:attr:`Tracker.tracker` is the object of the package underneath (TensorBoard's ``SummaryWriter``). A new
tracker is one ``TRACKERS.register(...)`` line here, and every front that reads the registry offers it:
``shardkit.Accelerator(log_with="name")`` today.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from typing import Any

from typing_extensions import override

from shardkit.registry import Registry

__all__ = ["TRACKERS", "JsonlTracker", "TensorBoardTracker", "Tracker", "available_trackers"]

TRACKERS = Registry("tracker")


class Tracker:
    """The interface of every tracker (Accelerate's ``GeneralTracker`` has the same methods and names).

    Args:
        run_name: the run (or project) the records belong to.
        logging_dir: the directory the tracker writes under.
    """

    name = "tracker"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | Path) -> None:
        self.run_name = str(run_name)
        self.logging_dir = Path(logging_dir)

    @classmethod
    def is_available(cls) -> bool:
        """Whether the packages this tracker writes through import here."""
        return True

    @property
    def tracker(self) -> Any:
        """The object of the package underneath (``self`` where there is none)."""
        return self

    def start(self) -> None:
        """Open the run (called once, before the first record); nothing by default."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record the run's hyperparameters once."""
        raise NotImplementedError

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record ``values`` (numbers and text) at ``step``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Flush and close; nothing by default."""


def _plain(value: Any) -> Any:
    """A value JSON can hold: tensors and numpy scalars as numbers, non-finite floats as text (JSON has no NaN)."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlTracker(Tracker):
    """One JSON object a line in ``<logging_dir>/<run_name>.jsonl``: the configuration first (``{"config": ...}``),
    then each ``log`` as ``{"step": ..., "time": ..., **values}``."""

    name = "jsonl"

    @override
    def __init__(self, run_name: str, logging_dir: str | Path) -> None:
        super().__init__(run_name, logging_dir)
        safe = self.run_name.replace("/", "_").replace("\\", "_").strip("._") or "run"
        self.path = self.logging_dir / f"{safe}.jsonl"

    def _append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, default=str) + "\n")

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._append({"config": {k: _plain(v) for k, v in values.items()}, "time": time.time()})

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._append({"step": step, "time": time.time(), **{k: _plain(v) for k, v in values.items()}})


class TensorBoardTracker(Tracker):
    """TensorBoard event files under ``<logging_dir>/<run_name>`` (needs the ``tensorboard`` package): numbers as
    scalars, text as text, dicts of numbers as grouped scalars, the configuration as hyperparameters.

    Args:
        **kwargs: given to ``torch.utils.tensorboard.SummaryWriter`` (``flush_secs``, ``max_queue`` ...).
    """

    name = "tensorboard"

    @override
    def __init__(self, run_name: str, logging_dir: str | Path, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer imports the tensorboard package
            raise ImportError("the tensorboard tracker needs the `tensorboard` package: pip install tensorboard") \
                from err
        self.writer = SummaryWriter(log_dir=str(self.logging_dir / self.run_name), **kwargs)

    @classmethod
    @override
    def is_available(cls) -> bool:
        return importlib.util.find_spec("tensorboard") is not None

    @property
    @override
    def tracker(self) -> Any:
        return self.writer

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        plain = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in values.items()}
        self.writer.add_hparams(plain, metric_dict={}, run_name=".")
        self.writer.flush()

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            value = _plain(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                raise TypeError(f"tensorboard tracker: {key!r} is a {type(value).__name__}; log numbers, text or "
                                f"dicts of numbers")
        self.writer.flush()

    @override
    def finish(self) -> None:
        self.writer.close()


TRACKERS.register("jsonl", "shardkit.tracking:JsonlTracker", aliases=("json",),
                  description="JSON lines in <logging_dir>/<run_name>.jsonl")
TRACKERS.register("tensorboard", "shardkit.tracking:TensorBoardTracker",
                  description="TensorBoard event files (pip install tensorboard)")


def available_trackers() -> list[str]:
    """The registered trackers whose packages import here (what ``log_with="all"`` means)."""
    return [name for name in TRACKERS.names() if TRACKERS.get_class(name).is_available()]
