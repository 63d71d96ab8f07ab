"""TrainerState (saved as trainer_state.json in every checkpoint) and TrainerControl (callbacks' flags)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TrainerState", "TrainerControl", "TRAINER_STATE_NAME"]

TRAINER_STATE_NAME = "trainer_state.json"


@dataclass
class TrainerState:
    """Where training stands; what callbacks read. Field names follow Hugging Face's.

    Attributes:
        epoch: fractional epoch (``epoch + steps into it / steps per epoch``).
        global_step: optimizer steps taken (including steps an FP16 overflow skipped).
        max_steps: optimizer steps the run will take.
        log_history: every dict passed to ``on_log`` (and each evaluation's metrics).
        best_metric, best_model_checkpoint, best_global_step: the best evaluation so far.
        stateful_callbacks: each stateful callback's ``state()`` by class name (restored on resume).
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

    def save_to_json(self, path: str | Path) -> None:
        """Write the state as indented JSON (atomic enough: the checkpoint directory is renamed whole)."""
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, path: str | Path) -> TrainerState:
        """Read a trainer_state.json; unknown keys (from a newer version or Hugging Face) are dropped."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); the checkpoint is damaged: "
                             "resume from another") from err
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the Trainer resets each after acting on it."""

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
        return {"args": dataclasses.asdict(self), "attributes": {}}
