"""Experiment tracking of :class:`shardkit.Accelerator` through :data:`shardkit.observability.trackers.TRACKERS`.

``Accelerator(log_with="jsonl", project_dir="runs")`` then ``init_trackers("my_run", config)``, ``log(values,
step)`` and ``end_training()``, on the main process only, as in Accelerate. Any tracker registered in
:data:`shardkit.observability.trackers.TRACKERS` is accepted by name; Accelerate-style tracker objects (with ``name``,
``start``, ``store_init_configuration``, ``log``, ``finish``) are used as they are.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from shardkit.accelerate_compat.plugins import ProjectConfiguration
from shardkit.accelerate_compat.state import ProcessFacts
from shardkit.observability.trackers import TRACKERS, Tracker, available_trackers
from shardkit.runner.core import Runner

__all__ = ["AcceleratorTracking"]


class _Blank(Tracker):
    """What ``get_tracker`` gives on processes that do not track (every call does nothing)."""

    name = "blank"

    @override
    def __init__(self) -> None:
        super().__init__("blank", ".")

    @override
    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    @override
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        pass


def _names(log_with: Any) -> list[Any]:
    """``log_with`` as a list of registry names and tracker objects ("all": every tracker that imports here)."""
    if log_with is None:
        return []
    items = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    out: list[Any] = []
    for item in items:
        if not isinstance(item, str) and not hasattr(item, "value") and callable(getattr(item, "log", None)):
            out.append(item)  # a tracker object
            continue
        name = str(getattr(item, "value", item)).lower()
        if name == "all":
            out.extend(n for n in available_trackers() if n not in out)
            continue
        canonical = TRACKERS.canonical(name)  # unknown: the registry's error with the closest name
        if canonical not in out:
            out.append(canonical)
    return out


class AcceleratorTracking:
    """``init_trackers``, ``log``, ``get_tracker`` and ``end_training``, which :class:`shardkit.Accelerator` forwards
    to. It owns the trackers; it is handed the Runner (torn down by ``end_training``), the project configuration
    (the trackers' directory) and the process facts (only the main process logs)."""

    def __init__(self, log_with: Any, runner: Runner, project_configuration: ProjectConfiguration,
                 facts: ProcessFacts) -> None:
        self.runner = runner
        self.project_configuration = project_configuration
        self.facts = facts
        self.log_with = _names(log_with)
        self.trackers: list[Any] = []
        needs_dir = [n for n in self.log_with
                     if isinstance(n, str) and TRACKERS.get_class(n).requires_logging_directory]
        if needs_dir and self.logging_dir is None:
            raise ValueError(f"log_with={needs_dir} writes files: give Accelerator(project_dir=...) or "
                             f"ProjectConfiguration(logging_dir=...)")

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    def init_trackers(self, project_name: str, config: dict[str, Any] | None = None,
                      init_kwargs: dict[str, dict[str, Any]] | None = None) -> None:
        """Start every tracker of ``log_with`` for the run ``project_name`` (main process only) and record ``config``.

        Args:
            init_kwargs: per tracker name, keyword arguments for its constructor (``{"tensorboard": {"flush_secs":
                60}}``).
        """
        if not self.facts.is_main_process:
            return
        init_kwargs = dict(init_kwargs or {})
        names = {n if isinstance(n, str) else getattr(n, "name", "") for n in self.log_with}
        unknown = sorted(set(init_kwargs) - names)
        if unknown:
            raise ValueError(f"init_kwargs names {unknown}, which are not in log_with={self.log_with}")
        for item in self.log_with:
            if isinstance(item, str):
                item = TRACKERS.build(item, run_name=project_name, logging_dir=self.logging_dir,
                                      **init_kwargs.get(item, {}))
            self.trackers.append(item)
        for tracker in self.trackers:
            tracker.start()
            if config is not None:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (``unwrap=True``: the package's own object, e.g. TensorBoard's writer).
        Processes other than the main one get a tracker that does nothing."""
        if not self.trackers:
            return _Blank()
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"{name!r} is not a tracker of this Accelerator; it has {[t.name for t in self.trackers]}")

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Record ``values`` at ``step`` with every tracker (main process only)."""
        if not self.facts.is_main_process:
            return
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish every tracker, then leave the process group (every process must call it)."""
        from shardkit.accelerate_compat.state import forget_state

        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.runner.teardown()
        forget_state()
