"""The Runner's checkpoints: synchronous and background saves, and loads (a mixin of :class:`Runner`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit import checkpoint as ckpt
from shardkit.checkpoint.async_save import AsyncCheckpointer
from shardkit.runner.user_state import StateSaver

__all__ = ["RunnerCheckpoints"]

_RUNNER_STATE = "runner"


class RunnerCheckpoints:
    """``save`` (blocking or in the background), ``wait_for_save`` and ``load`` of a Runner's state."""

    def save(self, path: str | Path, state: dict[str, Any], *, blocking: bool = True, update_latest: bool = True,
             on_saved: Callable[[Path], None] | None = None) -> Path:
        """Save a checkpoint directory atomically.

        ``state`` maps names to models, optimizers, schedulers, data loaders and plain values; the
        precision's state, the accumulation position and every rank's RNG state are added. The
        parent directory's ``latest`` pointer moves to the new save once it is complete (unless
        ``update_latest=False``: the Trainer finds its ``checkpoint-N`` folders by name).

        With ``blocking=False`` the state is copied to host memory (pinned, from GPUs) and the call returns while
        a background thread writes the same atomic, verified checkpoint; the strategy's gathers still run here.
        At most one save is in flight: the next ``save``, ``load``, :meth:`wait_for_save` and :meth:`teardown`
        wait for it, and raise a ``CheckpointError`` naming it if it failed. The host copy (the state's size) is
        kept for the next save. ``on_saved(path)`` runs once the checkpoint is published (on this rank; on the
        background thread for ``blocking=False``: file work only, no collectives).
        """
        path = Path(path)
        make_writer = functools.partial(
            ckpt.CheckpointWriter, path, rank=self.rank, world_size=self.world_size, broadcast=self.broadcast,
            keep_last=self.checkpoint_keep_last, info=self.strategy.checkpoint_info(),
            update_latest=update_latest, scripts=self.strategy.checkpoint_scripts())
        if not blocking:
            self._saves().save(path, make_writer, functools.partial(self._write_checkpoint, state=state), on_saved)
            return path
        self.wait_for_save()
        with make_writer(barrier=self.barrier) as writer:
            self._write_checkpoint(writer, state)
        if on_saved is not None:
            on_saved(path)
        return path

    def _write_checkpoint(self, writer: Any, state: dict[str, Any]) -> None:
        StateSaver(self.strategy, self._owner_of).save(writer, state)
        if self.is_main_process:
            writer.write_json("precision", self.precision.state_dict())
            writer.write_json(_RUNNER_STATE, self._runner_state())
        writer.write_state(ckpt.rank_entry("rng", self.rank), ckpt.capture_rng_state())

    def wait_for_save(self) -> Path | None:
        """Wait for the background save in flight (``save(..., blocking=False)``); return its path, or None.

        Raises:
            CheckpointError: that save failed; the message names the checkpoint (the previous one is untouched).
        """
        return self._async_saves.wait() if self._async_saves is not None else None

    def _saves(self) -> AsyncCheckpointer:
        if self._async_saves is None:
            from shardkit.distributed.process_group import default_timeout

            self._async_saves = AsyncCheckpointer(self.rank, self.world_size, default_timeout())
        return self._async_saves

    def load(self, path: str | Path, state: dict[str, Any], *, verify: bool = True,
             runner_state: bool = True) -> dict[str, Any]:
        """Restore the objects in ``state`` in place from a checkpoint; return its plain values.

        ``path`` may be a checkpoint directory or its parent (the ``latest`` pointer is followed).
        Every file read is checked against the manifest's sha256 in the same pass that reads it;
        ``verify=False`` skips the hashes (sizes, schema and paths are still checked).
        ``runner_state=False`` restores only ``state``: the precision's loss scale, the step count,
        the accumulation position and the RNG streams stay as they are (loading the best weights).
        """
        self.wait_for_save()
        with ckpt.CheckpointReader(path, verify=verify) as reader:
            saver = StateSaver(self.strategy, self._owner_of)
            values = saver.load(reader, state)
            if not runner_state:
                return values
            self.precision.load_state_dict(reader.read_json("precision", check=ckpt.check_precision_state))
            self._load_runner_state(reader.read_json(_RUNNER_STATE, check=ckpt.check_runner_state))
            rng_name = ckpt.rank_entry("rng", self.rank)
            if reader.has(rng_name):
                ckpt.restore_rng_state(reader.read_state(rng_name))
            else:
                self.logger.warning("checkpoint %s has no RNG state for rank %d (saved with %d ranks); "
                                    "random streams start fresh", reader.path, self.rank, reader.world_size)
        return values

    def _runner_state(self) -> dict[str, Any]:
        return {"micro_step": self._micro_step, "boundary": self._boundary, "optimizer_steps": self.optimizer_steps,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def _load_runner_state(self, state: dict[str, Any]) -> None:
        self._micro_step, self._boundary = state["micro_step"], state["boundary"]
        self._set_window(self.gradient_accumulation_steps)
        self.optimizer_steps = state["optimizer_steps"]
        if self._module is not None:
            last = self.gradient_accumulation_steps - 1
            self.strategy.set_gradient_sync(self._module, self._micro_step == last)

    def _owner_of(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        owner = self._owners.get(optimizer)
        if owner is None:
            raise ValueError("save/load an optimizer only together with the model it was set up with in runner.setup()")
        return owner
