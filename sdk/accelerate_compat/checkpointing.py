"""Checkpoints of :class:`shardkit.Accelerator` (its ``checkpoints`` part): ``save_state``/``load_state`` in
shardkit's format.

``save_state(dir)`` is ``runner.save(dir, state)``: every prepared model, optimizer and scheduler, each prepared
data loader's position, the registered objects, the accumulation counter, the precision's loss scale and every
process's RNG state, written atomically as safetensors and JSON (no pickle), sharded the strategy's way.
``load_state(dir)`` restores all of it in place, so a resumed run continues exactly where the saved one was,
data position included (Accelerate restores positions only with ``use_stateful_dataloader=True``).
With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the directories are
``<project_dir>/checkpoints/checkpoint_<n>`` and ``total_limit`` keeps the newest ones, as in Accelerate.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.accelerate_compat.parts import Prepared
from shardkit.accelerate_compat.plugins import ProjectConfiguration
from shardkit.accelerate_compat.state import ProcessFacts
from shardkit.accelerate_compat.training import AcceleratorTraining
from shardkit.accelerate_compat.wrappers import PreparedDataLoader, SkipBatches
from shardkit.runner.core import Runner

__all__ = ["AcceleratorCheckpoints"]

_CHECKPOINTS = "checkpoints"
_NUMBERED = re.compile(r"^checkpoint_(\d+)$")
_STEP = "accelerate_step"


def _entry(kind: str, index: int) -> str:
    """Accelerate's naming: the first of a kind is ``model``, the next ``model_1`` ..."""
    return kind if index == 0 else f"{kind}_{index}"


class AcceleratorCheckpoints:
    """``save_state``/``load_state``, ``save_model`` and the project directories, which :class:`shardkit.Accelerator`
    forwards to. It owns the objects registered for checkpointing; it is handed the Runner (which writes and reads),
    what was prepared (the checkpoint's entries), the project configuration (directories, numbering), the training
    part (its micro-batch count is saved) and the process facts."""

    def __init__(self, runner: Runner, prepared: Prepared, project_configuration: ProjectConfiguration,
                 training: AcceleratorTraining, facts: ProcessFacts) -> None:
        self.runner = runner
        self.prepared = prepared
        self.project_configuration = project_configuration
        self.training = training
        self.facts = facts
        self.custom_objects: list[Any] = []

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number of the next automatically named checkpoint."""
        return self.project_configuration.iteration

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load ``objects`` (each with ``state_dict``/``load_state_dict``) with :meth:`save_state`."""
        invalid = [f"{i}: {type(o).__name__}" for i, o in enumerate(objects)
                   if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))]
        if invalid:
            raise ValueError(f"register_for_checkpointing needs objects with state_dict() and load_state_dict(); "
                             f"these have not: {', '.join(invalid)}")
        self.custom_objects.extend(objects)

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds, by entry name (the same names on save and load)."""
        state: dict[str, Any] = {}
        prepared = self.prepared
        for i, model in enumerate(prepared.models):
            state[_entry("model", i)] = model
        for i, optimizer in enumerate(prepared.optimizers):
            state[_entry("optimizer", i)] = optimizer.optimizer
        for i, scheduler in enumerate(prepared.schedulers):
            state[_entry("scheduler", i)] = scheduler.scheduler
        for i, loader in enumerate(prepared.dataloaders):
            state[_entry("dataloader", i)] = loader.base
        for i, obj in enumerate(self.custom_objects):
            state[f"custom_checkpoint_{i}"] = obj
        return state

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """Save everything needed to resume exactly (see the module docstring); every process must call it.

        Returns:
            The checkpoint directory.
        """
        if save_model_func_kwargs:
            raise NotImplementedError(f"save_state({', '.join(save_model_func_kwargs)}=...): no DeepSpeed "
                                      f"save_checkpoint options here (shardkit's own format is written)")
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            parent = Path(self._project("save_state")) / _CHECKPOINTS
            path = parent / f"checkpoint_{config.iteration}"
            if path.exists():
                raise ValueError(f"checkpoint directory {path} already exists: set accelerator.project_configuration."
                                 f"iteration to the number to continue from")
        elif output_dir is None:
            raise ValueError("save_state() needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming="
                             "True, project_dir=...)")
        else:
            path = Path(output_dir)
        _same_directory_everywhere(self.facts, "save_state", path)
        state = self._state()
        state[_STEP] = self.training.step
        self.runner.save(path, state)
        config.iteration += 1
        return str(path)

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        """Restore what :meth:`save_state` saved, in place (every process must call it). Without ``input_dir``,
        the newest automatically named checkpoint of the project."""
        if load_kwargs or load_model_func_kwargs:
            raise NotImplementedError("load_state() takes no load options here: shardkit's loader reads the "
                                      "checkpoint it wrote (tensors onto each process's device)")
        config = self.project_configuration
        if input_dir is None:
            if not config.automatic_checkpoint_naming:
                raise ValueError("load_state() needs an input_dir, or ProjectConfiguration(automatic_checkpoint_naming="
                                 "True, project_dir=...)")
            input_dir = Path(self._project("load_state")) / _CHECKPOINTS  # the runner follows `latest`
        path = Path(os.path.expanduser(str(input_dir)))
        _same_directory_everywhere(self.facts, "load_state", path)
        if not path.is_dir():
            raise ValueError(f"load_state: {str(path)!r} is not a directory; give a checkpoint save_state wrote")
        values = self.runner.load(path, self._state())
        self.training.step = int(values.get(_STEP, 0))
        for model in self.prepared.models:  # Accelerate reduces on every backward outside accumulate/no_sync
            self.runner.strategy.set_gradient_sync(model, True)
        for loader in self.prepared.dataloaders:
            loader.restored()
        self._continue_numbering(path)

    def _continue_numbering(self, path: Path) -> None:
        """After loading ``checkpoint_<n>``, the next automatic save is ``checkpoint_<n + 1>``."""
        if not self.project_configuration.automatic_checkpoint_naming:
            return
        if path.name == _CHECKPOINTS and (path / "latest").is_file():
            path = path / (path / "latest").read_text().strip()
        found = _NUMBERED.match(path.name)
        if found:
            self.project_configuration.iteration = int(found.group(1)) + 1

    def _project(self, what: str) -> str:
        if self.project_dir is None:
            raise ValueError(f"{what} with automatic checkpoint naming needs a project directory: "
                             f"Accelerator(project_dir=...) or ProjectConfiguration(project_dir=...)")
        return self.project_dir

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """The loader for the rest of an epoch, without its first ``num_batches`` batches (for resuming).

        For a prepared loader this sets its position: the next iteration starts at batch ``num_batches`` of the
        epoch it would run (the one :meth:`load_state` restored), so Accelerate's resume code and a restored
        position agree; later iterations start whole epochs again.
        """
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"skip_first_batches num_batches={num_batches!r} must be a whole number >= 0")
        if not isinstance(dataloader, PreparedDataLoader):
            return SkipBatches(dataloader, num_batches)
        dataloader.skip(num_batches)
        return dataloader

    # ---- whole models ------------------------------------------------------------------------------------

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict: whole CPU tensors on the main process (``{}`` on the others), gathered
        one module at a time under every strategy. Every process must call it."""
        return dict(self.runner.iter_full_state_dict(model))

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Write the whole model as safetensors (``model.safetensors``, or shards with an index past
        ``max_shard_size``) under every strategy; every process must call it."""
        from shardkit.checkpoint.hf import save_pretrained

        if not safe_serialization:
            raise NotImplementedError("save_model(safe_serialization=False): shardkit writes safetensors only")
        save_pretrained(self.runner, save_directory, model, max_shard_size=max_shard_size)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors for a dict of tensors) on the main process only."""
        if not self.facts.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in obj.items()}, str(f))
        else:
            torch.save(obj, f)


def _same_directory_everywhere(facts: ProcessFacts, what: str, path: Path) -> None:
    """Refuse, on every process, a checkpoint directory that differs between processes: a checkpoint is one
    directory every process writes its part into (it would otherwise wait for parts that never come)."""
    if facts.num_processes == 1:
        return
    from shardkit.accelerate_compat.operations import gather_object

    paths = gather_object([str(path.resolve())])
    if len(set(paths)) > 1:
        raise ValueError(f"{what} got different directories on different processes ({', '.join(paths)}): a "
                         f"checkpoint is one directory shared by every process; pass the same path everywhere (e.g. "
                         f"made on the main process and broadcast with gather_object/broadcast_object_list)")
