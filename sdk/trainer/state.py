"""TrainerState (saved as trainer_state.json in every checkpoint) and TrainerControl (callbacks' flags).

A state read back from a file is hostile input: :meth:`TrainerState.from_dict` checks every field's type
and range and raises :class:`TrainerStateError` naming the file and the field (a ``global_step`` of "abc",
-5 or 10**12 past ``max_steps``, a ``log_history`` that is not a list of objects).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ExportableState", "TrainerState", "TrainerControl", "TrainerStateError", "TRAINER_STATE_NAME",
           "export_callback_states"]

TRAINER_STATE_NAME = "trainer_state.json"
_MAX_STATE_BYTES = 256 << 20  # a trainer_state.json grows with log_history: 1e5 logs of 20 values is ~100 MB
_MAX_INT = 2**53  # JSON integers beyond this are not exact in most readers


class ExportableState:
    """Mixin for objects whose state goes into checkpoints (stateful callbacks, TrainerControl): ``state()``
    returns ``{"args": constructor keywords, "attributes": values to restore}``, both JSON."""

    def state(self) -> dict[str, Any]:
        """``{"args": ..., "attributes": ...}``; subclasses implement it."""
        raise NotImplementedError("a stateful callback must implement state()")

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Any:
        """A new instance built with ``state["args"]``, then given ``state["attributes"]``."""
        instance = cls(**dict(state.get("args", {})))
        instance.load_state(state)
        return instance

    def load_state(self, saved: Mapping[str, Any]) -> None:
        """Restore ``saved["attributes"]`` onto this instance."""
        for key, value in dict(saved.get("attributes", {})).items():
            setattr(self, key, value)


class TrainerStateError(ValueError):
    """A trainer state (trainer_state.json, or the copy inside a checkpoint) is damaged or was tampered with;
    the message names the file and the field."""


@dataclass
class TrainerState:
    """Where training stands; what callbacks read. Field names and defaults follow Hugging Face's.

    Attributes:
        epoch: fractional epoch (``epoch + batches into it / batches per epoch``).
        global_step: optimizer steps taken (including steps an FP16 overflow skipped).
        max_steps: optimizer steps the run will take.
        log_history: every dict passed to ``on_log`` (and each evaluation's metrics), with its ``step``.
        best_metric, best_model_checkpoint, best_global_step: the best evaluation so far.
        stateful_callbacks: each stateful callback's ``state()`` by class name (a list for several instances).
    """

    epoch: float | None = None
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.log_history is None:
            self.log_history = []
        if self.stateful_callbacks is None:
            self.stateful_callbacks = {}
        elif not isinstance(self.stateful_callbacks, Mapping):  # a list of callbacks: their exported states
            self.stateful_callbacks = export_callback_states(self.stateful_callbacks)

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """Store ``logging_steps``/``eval_steps``/``save_steps`` as step counts (a ratio < 1 is of ``max_steps``)."""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps")
            if value is not None:
                setattr(self, f"{kind}_steps", math.ceil(max_steps * value) if value < 1 else value)

    def save_to_json(self, path: str | Path) -> None:
        """Write the state as indented JSON."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, path: str | Path) -> TrainerState:
        """Read and check a trainer_state.json (shardkit's or Hugging Face's); unknown keys are dropped.

        Raises:
            TrainerStateError: not a regular file, too large, not JSON, or a field of the wrong type or range.
        """
        from shardkit.checkpoint.format import CheckpointError
        from shardkit.checkpoint.trust import read_json_file

        file = Path(path)
        try:  # a regular file (no symlink, FIFO or device), at most _MAX_STATE_BYTES, UTF-8 JSON
            data = read_json_file(file, _MAX_STATE_BYTES, "trainer state")
        except CheckpointError as err:
            raise TrainerStateError(f"{err}; the checkpoint is damaged: resume from another") from None
        return cls.from_dict(data, str(file))

    @classmethod
    def from_dict(cls, data: Any, where: str = "trainer state") -> TrainerState:
        """A state from parsed JSON, every field checked (see :class:`TrainerStateError`)."""
        if not isinstance(data, dict):
            raise TrainerStateError(f"{where} must hold a JSON object, not a {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        for key, value in values.items():
            _check_field(key, value, where)
        state = cls(**values)
        if state.max_steps > 0 and state.global_step > state.max_steps:
            raise TrainerStateError(f"{where}: global_step={state.global_step} is past max_steps={state.max_steps}; "
                                    "the file was edited or is from another run: resume from another checkpoint")
        return state


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < _MAX_INT


def _is_number(value: Any, low: float | None = 0.0) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and (low is None or value >= low))


def _json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, bool)) or (isinstance(value, numbers.Real))


_CHECKS: dict[str, tuple[Any, str]] = {
    "epoch": (lambda v: v is None or _is_number(v), "a number >= 0 or null"),
    "global_step": (_is_int, "an integer >= 0"),
    "max_steps": (_is_int, "an integer >= 0"),
    "logging_steps": (lambda v: _is_number(v), "a number >= 0"),
    "eval_steps": (lambda v: v is None or _is_number(v), "a number >= 0"),
    "save_steps": (lambda v: _is_number(v), "a number >= 0"),
    "train_batch_size": (lambda v: v is None or _is_int(v, 1), "an integer >= 1 or null"),
    "num_train_epochs": (lambda v: _is_number(v), "a number >= 0"),
    "num_input_tokens_seen": (_is_int, "an integer >= 0"),
    "total_flos": (lambda v: _is_number(v), "a number >= 0"),
    "log_history": (lambda v: isinstance(v, list) and all(
        isinstance(e, dict) and all(isinstance(k, str) and _json_scalar(x) for k, x in e.items()) for e in v),
        "a list of objects of numbers and strings"),
    "best_metric": (lambda v: v is None or _is_number(v, None), "a finite number or null"),
    "best_global_step": (lambda v: v is None or _is_int(v), "an integer >= 0 or null"),
    "best_model_checkpoint": (lambda v: v is None or isinstance(v, str), "a path string or null"),
    "is_local_process_zero": (lambda v: isinstance(v, bool), "true or false"),
    "is_world_process_zero": (lambda v: isinstance(v, bool), "true or false"),
    "is_hyper_param_search": (lambda v: isinstance(v, bool), "true or false"),
    "trial_name": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "trial_params": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "stateful_callbacks": (lambda v: isinstance(v, dict) and all(
        isinstance(s, dict) or (isinstance(s, list) and all(isinstance(x, dict) for x in s)) for s in v.values()),
        "an object of callback states"),
}


def _check_field(key: str, value: Any, where: str) -> None:
    check, expected = _CHECKS[key]
    if not check(value):
        shown = value if isinstance(value, (int, float, bool, type(None))) else f"a {type(value).__name__}"
        raise TrainerStateError(f"{where}: field {key!r} must be {expected}, got {shown!r}; the file was damaged "
                                "or edited: resume from another checkpoint")


def export_callback_states(callbacks: Any) -> dict[str, Any]:
    """``{class name: state()}`` of the ExportableState callbacks; several of one class become a list."""
    states: dict[str, Any] = {}
    for callback in callbacks:
        if not isinstance(callback, ExportableState):
            raise TypeError(f"stateful_callbacks takes ExportableState callbacks, not {type(callback).__name__}")
        name = type(callback).__name__
        if name in states:
            if not isinstance(states[name], list):
                states[name] = [states[name]]
            states[name].append(callback.state())
        else:
            states[name] = callback.state()
    return states


@dataclass
class TrainerControl(ExportableState):
    """Flags callbacks set to steer the loop; the Trainer resets each after acting on it. Saved in checkpoints."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    def state(self) -> dict[str, Any]:
        """``{"args": the flags, "attributes": {}}`` (the ExportableState form)."""
        return {"args": dataclasses.asdict(self), "attributes": {}}
