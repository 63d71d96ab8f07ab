"""Checkpoints of a Trainer run: the Runner's format (no pickle) plus trainer_state.json, rotation, best model."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

from shardkit.trainer.peft_support import checkpoint_module, is_peft_model, save_adapters
from shardkit.trainer.state import TRAINER_STATE_NAME, TrainerState

__all__ = ["CheckpointMixin", "PREFIX_CHECKPOINT_DIR", "get_last_checkpoint", "sorted_checkpoints"]

PREFIX_CHECKPOINT_DIR = "checkpoint"
_MANIFEST = "shardkit.json"  # written last by the Runner's atomic save: its presence means complete
_STATE_VALUE = "trainer_state"
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def sorted_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete ``checkpoint-N`` directories in ``output_dir``, oldest (smallest N) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NUMBERED.match(p.name)) and (p / _MANIFEST).is_file()]
    return [p for _, p in sorted(found)]


def get_last_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``, or None."""
    found = sorted_checkpoints(output_dir)
    return str(found[-1]) if found else None


class CheckpointMixin:
    """Save, rotate, resume and select the best checkpoint; mixed into Trainer."""

    def _checkpoint_state(self, full: bool) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self._checkpoint_model()}
        if full:
            state.update(optimizer=self.optimizer, loader=self._train_loader)
            if self.lr_scheduler is not None:
                state["scheduler"] = self.lr_scheduler
            state["tr_loss"] = self._pending_losses_state()
        state[_STATE_VALUE] = json.dumps(self._state_for_save())
        return state

    def _checkpoint_model(self) -> Any:
        """The "model" entry: a peft model's trainable parameters only (its base is frozen), else the model."""
        return checkpoint_module(self.runner, self.model)

    def _state_for_save(self) -> dict[str, Any]:
        from dataclasses import asdict

        from shardkit.trainer.callbacks import ExportableState

        self.state.stateful_callbacks = {type(cb).__name__: cb.state() for cb in self.callback_handler.callbacks
                                         if isinstance(cb, ExportableState)}
        self.state.stateful_callbacks["TrainerControl"] = self.control.state()
        return asdict(self.state)

    def _save_checkpoint(self) -> Path:
        """Save ``checkpoint-<global_step>`` and its trainer_state.json, then rotate old ones."""
        from shardkit.trainer.optim_modes import to_eval

        to_eval(self)  # schedule-free: the checkpoint holds the averaged weights (training swaps back)
        path = Path(self.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._note_best_checkpoint(path)
        peft = is_peft_model(self.runner.unwrap_model(self.model))
        # async_save: the copy of trainer_state.json and the rotation wait for the publish (the background thread);
        # peft's adapter files are written into the published directory, so those saves block.
        blocking = not self.args.async_save or peft
        saved = self._checkpoint_state(full=not self.args.save_only_model)  # sets state.stateful_callbacks
        state = copy.deepcopy(self.state)
        finish = functools.partial(self._after_publish, state) if self.runner.is_main_process else None
        self.runner.save(path, saved, blocking=blocking, on_saved=finish)
        if peft:  # peft's files too, as HF's checkpoints hold
            save_adapters(self.runner, self.model, path)
        self.runner.barrier("trainer-save")
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return path

    def _after_publish(self, state: Any, path: Path) -> None:
        # A copy for people and tools; resume reads the copy saved atomically inside the checkpoint.
        state.save_to_json(path / TRAINER_STATE_NAME)
        self._rotate_checkpoints()

    def _note_best_checkpoint(self, path: Path) -> None:
        if self.state.best_global_step == self.state.global_step:
            self.state.best_model_checkpoint = str(path)

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if limit is None:
            return
        found = sorted_checkpoints(self.args.output_dir)
        best = Path(self.state.best_model_checkpoint) if self.state.best_model_checkpoint else None
        # The best is kept whatever its age; with limit 1 and a best that is not the newest, keep 2 (as HF).
        keep = limit + 1 if (limit == 1 and best is not None and best in found and best != found[-1]) else limit
        candidates = [p for p in found if p != best]
        excess = len(found) - keep
        for old in candidates[: max(excess, 0)]:
            shutil.rmtree(old, ignore_errors=True)

    def _resolve_resume(self, resume: bool | str | None) -> Path | None:
        if resume is None or resume is False:
            return None
        if resume is True:
            last = get_last_checkpoint(self.args.output_dir)
            if last is None:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} has no complete "
                                 "checkpoint-N directory: train from scratch (resume_from_checkpoint=None) or pass "
                                 "a checkpoint path")
            return Path(last)
        path = Path(resume)
        if not (path / _MANIFEST).is_file():
            last = get_last_checkpoint(path)
            if last is None:
                raise ValueError(f"resume_from_checkpoint={str(resume)!r} is not a complete checkpoint "
                                 f"(no {_MANIFEST}) and holds no checkpoint-N: pass a checkpoint directory or True")
            path = Path(last)
        return path

    def _load_checkpoint(self, path: Path) -> None:
        """Restore model, optimizer, scheduler, data position, RNG and trainer state: O(1), no batch replay."""
        state: dict[str, Any] = {"model": self._checkpoint_model(), "optimizer": self.optimizer,
                                 "loader": self._train_loader}
        if self.lr_scheduler is not None:
            state["scheduler"] = self.lr_scheduler
        state.update(tr_loss={}, **{_STATE_VALUE: ""})
        try:
            values = self.runner.load(path, state)
        except Exception as err:
            if "optimizer" in str(err) and "no entry" in str(err):
                raise ValueError(f"{path} was saved with save_only_model=True: it holds no optimizer, scheduler or "
                                 "data position to resume from; load its weights with load_model(), train anew"
                                 ) from err
            raise
        saved = json.loads(values[_STATE_VALUE])
        names = set(TrainerState.__dataclass_fields__)
        self.state = TrainerState(**{k: v for k, v in saved.items() if k in names})
        self._restore_pending_losses(values.get("tr_loss"))
        self._restore_callback_states(self.state.stateful_callbacks)

    def _restore_callback_states(self, saved: dict[str, Any]) -> None:
        from shardkit.trainer.callbacks import ExportableState

        for cb in self.callback_handler.callbacks:
            name = type(cb).__name__
            if isinstance(cb, ExportableState) and name in saved:
                cb.load_state(saved[name])
        control = saved.get("TrainerControl", {}).get("args")
        if control:
            for key, value in control.items():
                setattr(self.control, key, value)

    def load_model(self, path: str | Path) -> None:
        """Load only the model weights of a checkpoint (any strategy, any world size) into the Trainer's model."""
        self._ensure_setup()
        self.runner.load(path, {"model": self._checkpoint_model()})

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not (Path(best) / _MANIFEST).is_file():
            self.runner.logger.warning("load_best_model_at_end: no best checkpoint was saved; keeping the last weights")
            return
        if self.runner.is_main_process:
            self.runner.logger.info("loading the best model from %s (%s=%s)", best, self.args.metric_for_best_model,
                                    self.state.best_metric)
        steps = self.runner.optimizer_steps
        self.runner.load(best, {"model": self._checkpoint_model()})
        self.runner.optimizer_steps = steps  # the weights go back; the count of steps taken does not

    def _pending_losses_state(self) -> dict[str, Any]:
        # Losses of the steps since the last log: the resumed run's next log averages the same steps.
        return {"pending": [float(v) for v in self._gather_pending_losses()], "total": list(self._loss_total)}

    def _restore_pending_losses(self, saved: Any) -> None:
        saved = saved or {}
        self._pending_global = [float(v) for v in saved.get("pending", [])]
        self._loss_total = list(saved.get("total", [0.0, 0]))
        self._pending_local = []
