"""Experiment trackers by name: one registry that every front of shardkit logs through.

    from shardkit.observability.trackers import TRACKERS
    tracker = TRACKERS.build("jsonl", run_name="my_project", logging_dir="runs/logs")
    tracker.store_init_configuration({"lr": 3e-4})
    tracker.log({"loss": 1.25}, step=10)
    tracker.finish()

A tracker is a :class:`Tracker`: built with ``(run_name, logging_dir, **options)``, it keeps hyperparameters
once (:meth:`Tracker.store_init_configuration`) and metrics per step (:meth:`Tracker.log`), and
:attr:`Tracker.tracker` is the object of the package underneath (TensorBoard's ``SummaryWriter``, the W&B run,
the ``MlflowClient``). A new tracker is one ``TRACKERS.register(...)`` line here, and every front that reads the
registry offers it: ``Runner(log_with=...)``, ``TrainingArguments(report_to=...)``,
``shardkit.Accelerator(log_with=...)`` and a DeepSpeed config's ``tensorboard``/``wandb``/``csv_monitor`` sections.

Registered: ``jsonl``, ``csv`` (no package needed), ``tensorboard``, ``wandb`` (its offline mode writes run files
with no account: ``WANDB_MODE=offline``) and ``mlflow`` (``mlflow-skinny`` suffices; a local file store under
``<logging_dir>/mlruns`` unless ``MLFLOW_TRACKING_URI`` or ``tracking_uri=`` names another).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typing_extensions import override

from shardkit.utils.registry import Registry

__all__ = ["TRACKERS", "CSVTracker", "JsonlTracker", "MLflowTracker", "TensorBoardTracker", "Tracker", "TrackerSpec",
           "WandBTracker", "available_trackers", "build_trackers"]

TRACKERS = Registry("tracker")
log = logging.getLogger("shardkit.observability.trackers")


@dataclass(frozen=True)
class TrackerSpec:
    """A tracker to build later, where it is known (a config file) before the run's main process is.

    Attributes:
        name: its name in :data:`TRACKERS`.
        run_name: the run (or project) it records.
        logging_dir: where it writes.
        options: keyword arguments for its constructor.
        source: where it was asked for, for messages (``"ds_config.json: tensorboard"``).
    """

    name: str
    run_name: str
    logging_dir: str
    options: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def build(self) -> Tracker:
        """The tracker, started."""
        tracker = TRACKERS.build(self.name, run_name=self.run_name, logging_dir=self.logging_dir, **self.options)
        tracker.start()
        return tracker


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


def _safe_name(name: str) -> str:
    """A run name as one path component."""
    return str(name).replace("/", "_").replace("\\", "_").strip("._") or "run"


def _numbers(values: dict[str, Any]) -> tuple[dict[str, float], list[str]]:
    """The numeric values (tensors and numpy scalars as numbers), and the keys of the rest."""
    numbers, other = {}, []
    for key, value in values.items():
        value = _plain(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[key] = float(value)
        else:
            other.append(key)
    return numbers, other


class CSVTracker(Tracker):
    """``<logging_dir>/<run_name>/metrics.csv``: a header ``step,time,<key>...`` and a row per ``log`` (a key not seen
    before rewrites the file once with the wider header, as Lightning's CSVLogger does; a cell a row has no value
    for is empty), and the configuration in ``hparams.json`` beside it. Needs no package: read it with ``csv``."""

    name = "csv"

    @override
    def __init__(self, run_name: str, logging_dir: str | Path) -> None:
        super().__init__(run_name, logging_dir)
        self.directory = self.logging_dir / _safe_name(self.run_name)
        self.path = self.directory / "metrics.csv"
        self._columns: list[str] = ["step", "time"]
        self._rows: list[dict[str, Any]] = []

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        plain = {k: _plain(v) for k, v in values.items()}
        (self.directory / "hparams.json").write_text(json.dumps(plain, indent=1, default=str))

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        row = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in values.items()}}
        self._rows.append(row)
        new = [k for k in row if k not in self._columns]
        self.directory.mkdir(parents=True, exist_ok=True)
        if new or not self.path.exists():
            self._columns += new
            with self.path.open("w", newline="") as handle:  # the whole file again, under the wider header
                writer = csv.DictWriter(handle, self._columns)
                writer.writeheader()
                writer.writerows(self._rows)
        else:
            with self.path.open("a", newline="") as handle:
                csv.DictWriter(handle, self._columns).writerow(row)


class WandBTracker(Tracker):
    """A Weights & Biases run (needs ``wandb``): ``wandb.init(project=run_name, dir=logging_dir, **options)`` (no
    ``dir`` when ``WANDB_DIR`` is set: wandb reads it, as under Hugging Face's callback), the
    configuration as the run's config, each ``log`` as a history row at ``step``. ``WANDB_MODE=offline`` (or
    ``mode="offline"``) writes the run under ``<logging_dir>/wandb/offline-run-*`` with no account; ``wandb sync``
    uploads it later.

    Args:
        **options: given to ``wandb.init`` (``project`` overrides ``run_name``; ``name``, ``group``, ``entity``,
            ``mode``, ``tags`` ...).
    """

    name = "wandb"

    @override
    def __init__(self, run_name: str, logging_dir: str | Path, **options: Any) -> None:
        super().__init__(run_name, logging_dir)
        try:
            import wandb
        except ImportError as err:
            raise ImportError("the wandb tracker needs the `wandb` package: pip install wandb") from err
        project = options.pop("project", None) or os.environ.get("WANDB_PROJECT") or self.run_name
        if "dir" not in options and not os.environ.get("WANDB_DIR"):  # WANDB_DIR is wandb's to read, as HF leaves it
            self.logging_dir.mkdir(parents=True, exist_ok=True)
            options["dir"] = str(self.logging_dir)
        self.run = wandb.init(project=project, **options)

    @classmethod
    @override
    def is_available(cls) -> bool:
        return importlib.util.find_spec("wandb") is not None

    @property
    @override
    def tracker(self) -> Any:
        return self.run

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update({k: _plain(v) for k, v in values.items()}, allow_val_change=True)

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log({k: _plain(v) for k, v in values.items()}, step=step, **kwargs)

    @override
    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(Tracker):
    """An MLflow run through ``MlflowClient`` (needs ``mlflow`` or ``mlflow-skinny``): the configuration as
    parameters, numbers as metrics at ``step`` (other values are skipped with one warning per key, MLflow holding
    numbers only).

    Args:
        tracking_uri: where runs go; default ``MLFLOW_TRACKING_URI``, else a file store in ``<logging_dir>/mlruns``.
        experiment_name: default ``MLFLOW_EXPERIMENT_NAME``, else ``run_name``.
        name: the MLflow run's name (default: MLflow's generated one).
        tags: tags of the run.
    """

    name = "mlflow"
    # MLflow's limits: 100 parameters a batch, a parameter's value at most 6000 characters (MAX_PARAM_VAL_LENGTH).
    _BATCH, _VALUE_CHARS = 100, 6000

    @override
    def __init__(self, run_name: str, logging_dir: str | Path, *, tracking_uri: str | None = None,
                 experiment_name: str | None = None, name: str | None = None,
                 tags: dict[str, str] | None = None) -> None:
        super().__init__(run_name, logging_dir)
        try:
            from mlflow import MlflowClient
        except ImportError as err:
            raise ImportError("the mlflow tracker needs MLflow: pip install mlflow-skinny") from err
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (self.logging_dir / "mlruns").resolve().as_uri()
            # NOTE: MLflow 3 refuses a file store unless this is set ("maintenance mode"); the file store is what a
            # run on one machine with mlflow-skinny (no SQL database packages) can use.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.run_name
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
        self._skipped: set[str] = set()

    @classmethod
    @override
    def is_available(cls) -> bool:
        return importlib.util.find_spec("mlflow") is not None

    @property
    @override
    def tracker(self) -> Any:
        return self.client

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(str(k), str(_plain(v))[: self._VALUE_CHARS]) for k, v in values.items()]
        for i in range(0, len(params), self._BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + self._BATCH])

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        from mlflow.entities import Metric

        numbers, other = _numbers(values)
        for key in set(other) - self._skipped:
            log.warning("mlflow tracker: %r is not a number; MLflow metrics hold numbers, so it is not logged", key)
            self._skipped.add(key)
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step or 0) for k, v in numbers.items()]
        for i in range(0, len(metrics), self._BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self._BATCH])

    @override
    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS.register("jsonl", "shardkit.observability.trackers:JsonlTracker", aliases=("json",),
                  description="JSON lines in <logging_dir>/<run_name>.jsonl")
TRACKERS.register("tensorboard", "shardkit.observability.trackers:TensorBoardTracker",
                  description="TensorBoard event files (pip install tensorboard)")
TRACKERS.register("csv", "shardkit.observability.trackers:CSVTracker",
                  description="<logging_dir>/<run_name>/metrics.csv and hparams.json")
TRACKERS.register("wandb", "shardkit.observability.trackers:WandBTracker", aliases=("weights_and_biases",),
                  description="a Weights & Biases run (pip install wandb; WANDB_MODE=offline needs no account)")
TRACKERS.register("mlflow", "shardkit.observability.trackers:MLflowTracker",
                  description="an MLflow run, a file store under <logging_dir>/mlruns by default "
                              "(pip install mlflow-skinny)")


def available_trackers() -> list[str]:
    """The registered trackers whose packages import here (what ``log_with="all"`` means)."""
    return [name for name in TRACKERS.names() if TRACKERS.get_class(name).is_available()]


def build_trackers(log_with: Any, run_name: str, logging_dir: str | Path) -> list[Tracker]:
    """Started trackers for ``log_with``: a name (``"all"``: every tracker whose package imports here), a
    :class:`TrackerSpec`, a tracker object, or a list of them.

    Raises:
        ValueError: an unknown name, with the closest registered one.
        ImportError: a tracker's package is missing, naming it.
    """
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    trackers: list[Tracker] = []
    for item in items:
        if isinstance(item, TrackerSpec):
            trackers.append(item.build())
        elif isinstance(item, str):
            names = available_trackers() if item.strip().lower() == "all" else [TRACKERS.canonical(item)]
            for name in names:
                tracker = TRACKERS.build(name, run_name=run_name, logging_dir=logging_dir)
                tracker.start()
                trackers.append(tracker)
        elif callable(getattr(item, "log", None)):
            trackers.append(item)  # a tracker object, started by whoever made it
        else:
            raise TypeError(f"log_with takes tracker names ({', '.join(TRACKERS.names())}, 'all'), TrackerSpec or "
                            f"tracker objects; got a {type(item).__name__}")
    return trackers
