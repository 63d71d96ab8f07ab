"""Checkpoints of a Trainer run: the Runner's format (no pickle, exact resume) plus the files Hugging Face's tools
read, rotation, the best checkpoint, and resuming from a checkpoint Hugging Face's Trainer wrote.

:class:`Checkpointer` owns the files; the parts of the run save their own state into it: the model, optimizer,
scheduler and data position through the Runner, the TrainerState and the callbacks as JSON, the
:class:`~shardkit.trainer.loss_tracker.LossTracker` through its ``state_dict()``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.checkpoint.discovery import complete_checkpoint_time
from shardkit.checkpoint.format import MANIFEST
from shardkit.trainer.hf_checkpoint import is_hf_checkpoint, load_hf_checkpoint, write_hf_files
from shardkit.trainer.peft_support import checkpoint_module, is_peft_model, save_adapters
from shardkit.trainer.state import (
    TRAINER_STATE_NAME,
    ExportableState,
    TrainerControl,
    TrainerState,
    export_callback_states,
)

__all__ = ["CheckpointParts", "Checkpointer", "PREFIX_CHECKPOINT_DIR", "checkpoints_by_age", "get_last_checkpoint",
           "sorted_checkpoints"]

logger = logging.getLogger("shardkit.trainer")

PREFIX_CHECKPOINT_DIR = "checkpoint"
_STATE_VALUE = "trainer_state"
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def _complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() or is_hf_checkpoint(path)


def sorted_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete ``checkpoint-N`` directories in ``output_dir`` (shardkit's or Hugging Face's), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NUMBERED.match(p.name) and _complete(p)]
    return sorted(found, key=_step)


def checkpoints_by_age(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints oldest first by modification time, as transformers' rotation orders them (a run resumed
    from checkpoint-5 beside an older run's checkpoint-10 writes a checkpoint-6 that is newer than checkpoint-10);
    by step number where the times span under a second, too close to tell apart on some filesystems."""
    found = sorted_checkpoints(output_dir)
    if len(found) < 2:
        return found
    by_time = sorted(found, key=lambda p: (p.stat().st_mtime, _step(p)))
    if by_time[-1].stat().st_mtime - by_time[0].stat().st_mtime < 1.0:
        return found
    return by_time


def _step(path: Path) -> int:
    return int(_NUMBERED.match(path.name).group(1))


def get_last_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``, or None. A shardkit checkpoint whose manifest fails its
    schema or whose files are missing or cut short is skipped (the one before it is taken)."""
    for path in reversed(sorted_checkpoints(output_dir)):
        if not (path / MANIFEST).is_file() or complete_checkpoint_time(path) is not None:
            return str(path)
        logger.warning(f"{path} is not a complete checkpoint (a file it lists is missing or cut short): skipped")
    return None


@dataclass
class CheckpointParts:
    """What a checkpoint holds, handed over by the Trainer at each save and load."""

    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    state: TrainerState
    control: TrainerControl
    callbacks: list[Any]
    losses: Any
    processing_class: Any = None
    data_collator: Any = None


class Checkpointer:
    """Saves, rotates and resumes ``checkpoint-N`` directories in ``args.output_dir``.

    Args:
        runner: the Trainer's Runner (saves and loads the model, optimizer, scheduler and data position).
        args: the TrainingArguments (output_dir, save_only_model, save_total_limit, restore_callback_states...).
    """

    def __init__(self, runner: Any, args: Any):
        self.runner, self.args = runner, args
        # called with each checkpoint folder before the rotation deletes it (the Trainer waits there for a Hub
        # upload still reading it)
        self.before_delete: Callable[[Path], None] = lambda path: None

    # ---- saving ----------------------------------------------------------------------------------

    def save(self, parts: CheckpointParts) -> Path:
        """Save ``checkpoint-<global_step>``: exact-resume state, Hugging Face's files, trainer_state.json."""
        state = parts.state
        path = Path(self.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self._note_best_checkpoint(state, path)
        state.stateful_callbacks = export_callback_states([cb for cb in parts.callbacks
                                                           if isinstance(cb, ExportableState)])
        state.stateful_callbacks["TrainerControl"] = parts.control.state()
        entries: dict[str, Any] = {"model": checkpoint_module(self.runner, parts.model)}
        if not self.args.save_only_model:
            entries.update(optimizer=parts.optimizer, loader=parts.loader)
            if parts.scheduler is not None:
                entries["scheduler"] = parts.scheduler
            entries["tr_loss"] = parts.losses.state_dict()
            for key, value in self.run_state(parts).items():
                if key in entries or key == _STATE_VALUE:
                    raise ValueError(f"{type(self).__name__}.run_state: {key!r} is a name the Trainer's checkpoint "
                                     "already uses; name the entry otherwise")
                entries[key] = value
        entries[_STATE_VALUE] = json.dumps(dataclasses.asdict(state))
        peft = is_peft_model(self.runner.unwrap_model(parts.model))
        if self.args.async_save and not peft:  # peft's adapters are written into the published directory
            self._save_in_background(path, entries, parts)
        else:
            self.runner.save(path, entries, update_latest=False)
            if peft:  # peft's files, as Hugging Face's checkpoints hold
                save_adapters(self.runner, parts.model, path)
            write_hf_files(self.runner, parts.model, path, parts.processing_class, parts.data_collator)
            if self.runner.is_main_process:
                self._finish_save(state, path)
        self.runner.barrier("trainer-save")
        return path

    def run_state(self, parts: CheckpointParts) -> dict[str, Any]:
        """More entries for ``Runner.save`` (a subclass's run state), written in the same atomic checkpoint as the
        rest, so that no checkpoint is ever published without them; a subclass's :meth:`load` reads them back. None
        here; not called for ``save_only_model`` (nothing resumes from it)."""
        return {}

    def _save_in_background(self, path: Path, entries: dict[str, Any], parts: CheckpointParts) -> None:
        """``async_save``: the Runner writes the checkpoint on a background thread. Hugging Face's files need
        gathers (collectives), so they are written here into a hidden sibling, moved in once the checkpoint is
        published, with trainer_state.json (this step's copy) and the rotation. Where the strategy keeps whole
        weights the checkpoint's own ``model.safetensors`` already is Hugging Face's file, and the staged copy is
        dropped (the Runner's file names are known only once it has written them)."""
        stage = path.parent / f".{path.name}.hf-files"
        if self.runner.is_main_process:
            shutil.rmtree(stage, ignore_errors=True)  # left by a run killed mid-save
            stage.mkdir(parents=True)
        self.runner.barrier("trainer-save-stage")
        write_hf_files(self.runner, parts.model, stage, parts.processing_class, parts.data_collator)
        state = copy.deepcopy(parts.state)

        def publish(published: Path) -> None:
            for file in stage.iterdir():
                if (published / file.name).exists():  # the checkpoint's own model.safetensors (whole weights)
                    file.unlink()
                else:
                    os.replace(file, published / file.name)
            stage.rmdir()
            self._finish_save(state, published)

        self.runner.save(path, entries, update_latest=False, blocking=False,
                         on_saved=publish if self.runner.is_main_process else None)

    def _finish_save(self, state: TrainerState, path: Path) -> None:
        """Main process: the readable trainer_state.json and training_args.json, then the rotation."""
        state.save_to_json(path / TRAINER_STATE_NAME)
        (path / "training_args.json").write_text(self.args.to_json_string() + "\n")
        self.rotate(state.best_model_checkpoint)

    def _note_best_checkpoint(self, state: TrainerState, path: Path) -> None:
        # As Hugging Face: the best checkpoint is the one saved at the best evaluation's step, if one was.
        if state.best_global_step is None:
            return
        best = path.parent / f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"
        if state.best_global_step == state.global_step or _complete(best):
            state.best_model_checkpoint = str(best)

    def rotate(self, best_model_checkpoint: str | None) -> None:
        """As transformers' ``rotate_checkpoints``: keep at most ``save_total_limit`` checkpoints, never deleting the
        most recent (to resume from) nor the best; with both protected and a limit of 1, two stay. The oldest
        others go first, ordered as transformers orders them (see :func:`checkpoints_by_age`)."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        found = checkpoints_by_age(self.args.output_dir)
        if len(found) <= limit:
            return
        protected = {found[-1]}
        if best_model_checkpoint is not None:
            protected.add(Path(best_model_checkpoint))
        remaining = len(found)
        for old in found:
            if remaining <= max(limit, len(protected)):
                break
            if old not in protected:
                logger.info(f"deleting {old} (save_total_limit={limit})")
                self.before_delete(old)
                shutil.rmtree(old, ignore_errors=True)
                remaining -= 1

    def keep_only_best(self, best_model_checkpoint: str | None) -> None:
        """End of train() with ``save_total_limit=1``: the rotation kept the newest checkpoint beside the best one
        for resuming; training is over, so only the best stays (as transformers does)."""
        if self.args.save_total_limit != 1 or best_model_checkpoint is None:
            return
        best = Path(best_model_checkpoint)
        if not best.is_dir():
            return
        for path in sorted_checkpoints(self.args.output_dir):
            if not os.path.samefile(path, best):
                logger.info(f"deleting {path} (save_total_limit=1 keeps the best checkpoint {best})")
                self.before_delete(path)
                shutil.rmtree(path, ignore_errors=True)

    # ---- resuming --------------------------------------------------------------------------------

    def resolve(self, resume: bool | str | None) -> Path | None:
        """The checkpoint ``resume_from_checkpoint`` names: True is the newest in output_dir, a path is that
        checkpoint (or the newest inside it), None/False is none. When ``shardkit launch --max-restarts`` restarted the
        job, None is the newest in output_dir when there is one (the job picks up where it failed).

        Rank 0 chooses for every rank (a collective: every rank calls it), as ``Runner.resume`` does: ranks that
        chose apart (a folder not yet the same on every machine) would load different steps and train on silently
        out of step; a rank that cannot read rank 0's choice fails at the load instead."""
        try:
            mine, error = self._choose(resume), None
        except ValueError as err:
            mine, error = None, err
        chosen, message = self.runner.broadcast([None if mine is None else str(mine),
                                                 None if error is None else str(error)], 0)
        if message is not None:
            if error is not None and str(error) == message:
                raise error
            raise ValueError(message)
        return None if chosen is None else Path(chosen)

    def _choose(self, resume: bool | str | None) -> Path | None:
        restarted = self.runner.observability.recovery.is_restart
        if resume is None and restarted:
            last = get_last_checkpoint(self.args.output_dir)
            logger.info(f"restarted by the launcher: resuming from {last}" if last else
                        f"restarted by the launcher, but {self.args.output_dir} holds no complete checkpoint yet: "
                        "training from the start")
            return Path(last) if last else None
        if resume is None or resume is False:
            return None
        if restarted and resume is not True:
            logger.warning(f"restarted by the launcher: resuming from {resume} as train() names it, not from the "
                           "newest checkpoint in output_dir; pass resume_from_checkpoint=True (or nothing) to pick up "
                           "where the job failed")
        if resume is True:
            last = get_last_checkpoint(self.args.output_dir)
            if last is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir}): it holds "
                                 "no complete checkpoint-N for resume_from_checkpoint=True; train from scratch "
                                 "(resume_from_checkpoint=None) or pass a checkpoint path")
            return Path(last)
        path = Path(resume)
        if not _complete(path):
            last = get_last_checkpoint(path)
            if last is None:
                raise ValueError(f"Can't find a valid checkpoint at {resume}: it is neither a complete checkpoint "
                                 f"({MANIFEST}, or Hugging Face's trainer_state.json + model.safetensors) nor a "
                                 "folder holding checkpoint-N ones; pass a checkpoint directory or True")
            path = Path(last)
        return path

    def load(self, path: Path, parts: CheckpointParts) -> tuple[TrainerState, bool]:
        """Restore everything from ``path``; returns (the saved TrainerState, whether the data position was
        restored exactly). O(1): the data position is restored, no batch is replayed."""
        self.runner.wait_for_save()  # async_save: a checkpoint still being written is published first
        if is_hf_checkpoint(path):
            load_hf_checkpoint(self.runner, parts.model, parts.optimizer, parts.scheduler, path)
            parts.losses.reset()
            return TrainerState.load_from_json(path / TRAINER_STATE_NAME), False
        entries: dict[str, Any] = {"model": checkpoint_module(self.runner, parts.model), "optimizer": parts.optimizer}
        if parts.scheduler is not None:
            entries["scheduler"] = parts.scheduler
        entries.update(tr_loss={}, **{_STATE_VALUE: ""})
        try:
            values = self.runner.load(path, entries)
        except Exception as err:
            if "optimizer" in str(err) and "no entry" in str(err):
                raise ValueError(f"{path} was saved with save_only_model=True: it holds no optimizer, scheduler or "
                                 "data position to resume from; load its weights with load_model(), train anew"
                                 ) from err
            raise
        where = f"{path} ({_STATE_VALUE})"
        try:
            saved = json.loads(values[_STATE_VALUE])
        except (TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"{where} is not valid JSON ({err}): resume from another checkpoint") from None
        state = TrainerState.from_dict(saved, where)
        parts.losses.load_state_dict(values.get("tr_loss"), f"{path} (tr_loss)")
        return state, self._load_loader(path, parts.loader)

    def _load_loader(self, path: Path, loader: Any) -> bool:
        """The data position; a dataset of another size (or seed) is logged and the position rebuilt."""
        from shardkit import checkpoint as ckpt

        if loader is None:
            return False
        with ckpt.CheckpointReader(path) as reader:
            entry = ckpt.rank_entry("loader", self.runner.rank)
            if not reader.has(entry):  # saved with fewer ranks: every rank's position is the same global one
                entry = ckpt.rank_entry("loader", 0)
            if not reader.has(entry):
                logger.warning(f"{path} has no data position for rank {self.runner.rank}: the position is derived "
                               "from the step count")
                return False
            saved = reader.read_json(entry)
        try:
            loader.load_state_dict(saved)
        except ValueError as err:
            logger.warning(f"{path}: the data position cannot be restored exactly ({err}); training continues "
                           "from the position the step count gives, over the current dataset")
            return False
        return True

    def load_model(self, path: str | Path, model: Any) -> None:
        """Only the model weights of a checkpoint (any strategy, any world size)."""
        self.runner.wait_for_save()
        path = Path(path)
        if is_hf_checkpoint(path):
            from shardkit.checkpoint.hf import load_pretrained

            load_pretrained(self.runner, model, path)
            return
        self.runner.load(path, {"model": checkpoint_module(self.runner, model)}, runner_state=False)
