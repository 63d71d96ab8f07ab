"""report_to: reporters by name. Every tracker of ``observability.trackers`` is one, and callbacks registered here.

``TrainingArguments(report_to=...)`` names reporters; the Trainer adds one callback per name
(:func:`reporter_callbacks`). A tracker registered in
``shardkit.observability.trackers.TRACKERS`` (JSON lines and TensorBoard
today) is a reporter here with no more code: :class:`TrackerCallback` builds it on the main process at the start of
training, stores the arguments as its configuration, sends it every log, and finishes it at the end. A reporter that
is a TrainerCallback of its own plugs in with :func:`register_reporter` (a class or factory, and whether its package
is installed, for ``report_to="all"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardkit.observability.trackers import TRACKERS, available_trackers
from shardkit.trainer.callbacks import TrainerCallback

__all__ = ["JsonlCallback", "TensorBoardCallback", "TrackerCallback", "available_reporters", "register_reporter",
           "reporter_callbacks", "reporter_names"]

_TAG_PREFIXES = (("eval_", "eval/"), ("test_", "test/"))


def _tags(logs: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's reporters' names for a log's values: ``eval_loss`` -> ``eval/loss``, ``loss`` ->
    ``train/loss``; numbers and text only (the rest is not a chart)."""
    out = {}
    for key, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        old, new = next(((old, new) for old, new in _TAG_PREFIXES if key.startswith(old)), ("", "train/"))
        out[new + key[len(old):]] = value
    return out


class TrackerCallback(TrainerCallback):
    """Sends the Trainer's logs to a tracker of ``shardkit.observability.trackers`` (main process only).

    Args:
        tracker: its name in ``shardkit.observability.trackers.TRACKERS``.
        tags: name the values as Hugging Face's reporters do (``train/loss``, ``eval/loss``); False keeps the
            ``log_history`` keys (the JSON-lines file then holds the same records as ``log_history``).
        **options: given to the tracker's constructor.

    Raises:
        ImportError: at construction, naming the package, when the tracker's package is not installed.
    """

    def __init__(self, tracker: str, *, tags: bool = True, **options: Any):
        self.name, self.tags, self.options = TRACKERS.canonical(tracker), tags, options
        if not TRACKERS.get_class(self.name).is_available():
            raise ImportError(f"report_to={tracker!r} needs the tracker's package: "
                              f"{TRACKERS.entry(self.name).description}")
        self.tracker: Any = None

    def _open(self, args: Any, state: Any) -> None:
        if self.tracker is None and state.is_world_process_zero:
            run = str(args.run_name).replace("/", "_").replace("\\", "_").strip("._") or "run"  # a path: one name
            self.tracker = TRACKERS.build(self.name, run_name=run, logging_dir=args.logging_dir, **self.options)
            self.tracker.start()
            self.tracker.store_init_configuration(args.to_dict())

    def on_train_begin(self, args, state, control, **kwargs):
        self._open(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._open(args, state)
        if self.tracker is not None and logs:
            self.tracker.log(_tags(logs) if self.tags else dict(logs), step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker is not None:
            self.tracker.finish()
            self.tracker = None


class JsonlCallback(TrackerCallback):
    """``report_to="jsonl"``: ``<logging_dir>/<run_name>.jsonl``, the arguments on the first line, then one line per
    log with its step and wall time (keys as in ``log_history``; non-finite numbers as text, JSON having none)."""

    def __init__(self):
        super().__init__("jsonl", tags=False)


class TensorBoardCallback(TrackerCallback):
    """``report_to="tensorboard"``: event files under ``<logging_dir>/<run_name>`` (needs ``tensorboard``)."""

    def __init__(self):
        super().__init__("tensorboard")


_REPORTERS: dict[str, tuple[Callable[[], TrainerCallback], Callable[[], bool]]] = {}
_TRACKER_REPORTERS = {"jsonl": JsonlCallback, "tensorboard": TensorBoardCallback}


def register_reporter(name: str, factory: Callable[[], TrainerCallback], available: Callable[[], bool] = lambda: True,
                      *, overwrite: bool = False) -> None:
    """Make ``report_to=name`` add ``factory()`` to the Trainer's callbacks; ``available()`` says whether its
    package is installed (``report_to="all"`` takes the available ones). The factory may raise ImportError
    naming the package to install, at Trainer construction. (A tracker of ``observability.trackers`` needs none of
    this: it is a reporter already.)"""
    if (name in _REPORTERS or name in TRACKERS) and not overwrite:
        raise ValueError(f"reporter {name!r} is already registered; pass overwrite=True to replace it")
    _REPORTERS[name] = (factory, available)


def reporter_names() -> list[str]:
    """Every reporter name (the trackers' and the registered callbacks'), plus "none" and "all"."""
    return sorted({*TRACKERS.names(), *TRACKERS.aliases(), *_REPORTERS, "none", "all"})


def available_reporters() -> list[str]:
    """The reporters whose packages are installed (what ``report_to="all"`` means)."""
    callbacks = [name for name, (_, available) in _REPORTERS.items() if available()]
    return sorted({*available_trackers(), *callbacks})


def reporter_callbacks(report_to: list[str]) -> list[TrainerCallback]:
    """One callback per name in ``report_to`` (names checked by TrainingArguments)."""
    out = []
    for name in report_to:
        if name in _REPORTERS:
            out.append(_REPORTERS[name][0]())
        else:
            canonical = TRACKERS.canonical(name)
            out.append(_TRACKER_REPORTERS.get(canonical, lambda n=canonical: TrackerCallback(n))())
    return out
