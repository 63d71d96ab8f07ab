"""The Runner's checkpoints: synchronous and background saves, and loads, as an object the Runner holds."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit import checkpoint as ckpt
from shardkit.checkpoint import format as ckpt_format
from shardkit.checkpoint.async_save import AsyncCheckpointer
from shardkit.checkpoint.discovery import newest_complete_checkpoint
from shardkit.precision import Precision
from shardkit.runner.recovery import RunRecovery
from shardkit.runner.user_state import StateSaver
from shardkit.strategies.base import Strategy

__all__ = ["RunnerCheckpoints"]

_RUNNER_STATE = ckpt_format.RUNNER_ENTRY
_PRECISION_STATE = ckpt_format.PRECISION_ENTRY


class RunnerCheckpoints:
    """``save`` (blocking or in the background), ``wait_for_save`` and ``load`` of a Runner's state.

    It owns the background saver and is handed the rest: the strategy (ranks, collectives, how state is gathered),
    the precision (its loss scale is saved), ``owners`` (the Runner's live map of each optimizer set up to its
    model), the two halves of the Runner's step position (``step_state`` reads it, ``restore_step_state`` sets it
    back), and the ``recovery`` that a restarted job's loads and saves are reported to.

    Args:
        keep_last: keep at most this many checkpoints next to each new one (None: all).
    """

    def __init__(self, strategy: Strategy, precision: Precision, *, keep_last: int | None,
                 owners: Mapping[torch.optim.Optimizer, nn.Module], step_state: Callable[[], dict[str, Any]],
                 restore_step_state: Callable[[dict[str, Any]], None], logger: logging.Logger | logging.LoggerAdapter,
                 recovery: RunRecovery):
        self.strategy = strategy
        self.precision = precision
        self.keep_last = keep_last
        self._owners = owners
        self._step_state = step_state
        self._restore_step_state = restore_step_state
        self._logger = logger
        self._recovery = recovery
        self._background: AsyncCheckpointer | None = None  # save(..., blocking=False), made on first use

    def _owner_of(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        owner = self._owners.get(optimizer)
        if owner is None:
            raise ValueError("save/load an optimizer only together with the model it was set up with in runner.setup()")
        return owner

    @property
    def background(self) -> AsyncCheckpointer | None:
        """The background saver (its host copy and the save in flight); None until the first ``blocking=False``."""
        return self._background

    def save(self, path: str | Path, state: dict[str, Any], *, blocking: bool = True, update_latest: bool = True,
             on_saved: Callable[[Path], None] | None = None) -> Path:
        """See :meth:`shardkit.Runner.save`."""
        path = Path(path)
        strategy = self.strategy
        on_saved = self._reporting_save(on_saved)
        make_writer = functools.partial(
            ckpt.CheckpointWriter, path, rank=strategy.rank, world_size=strategy.world_size,
            broadcast=strategy.broadcast, keep_last=self.keep_last, info=strategy.checkpoint_info(),
            update_latest=update_latest, scripts=strategy.checkpoint_scripts())
        if not blocking:
            self._saves().save(path, make_writer, functools.partial(self._write, state=state), on_saved)
            return path
        self.wait_for_save()
        with make_writer(barrier=strategy.barrier) as writer:
            self._write(writer, state)
        if on_saved is not None:
            on_saved(path)
        return path

    def _reporting_save(self, on_saved: Callable[[Path], None] | None) -> Callable[[Path], None]:
        step = self._step_state()["optimizer_steps"]

        def published(path: Path) -> None:
            self._recovery.saved(step)
            if on_saved is not None:
                on_saved(path)

        return published

    def _write(self, writer: Any, state: dict[str, Any]) -> None:
        StateSaver(self.strategy, self._owner_of).save(writer, state)
        if self.strategy.is_global_zero:
            writer.write_json(_PRECISION_STATE, self.precision.state_dict())
            writer.write_json(_RUNNER_STATE, self._step_state())
        writer.write_state(ckpt.rank_entry("rng", self.strategy.rank), ckpt.capture_rng_state())

    def wait_for_save(self) -> Path | None:
        """See :meth:`shardkit.Runner.wait_for_save`."""
        return self._background.wait() if self._background is not None else None

    def _saves(self) -> AsyncCheckpointer:
        if self._background is None:
            from shardkit.distributed.process_group import default_timeout

            self._background = AsyncCheckpointer(self.strategy.rank, self.strategy.world_size, default_timeout())
        return self._background

    def load(self, path: str | Path, state: dict[str, Any], *, verify: bool = True,
             runner_state: bool = True) -> dict[str, Any]:
        """See :meth:`shardkit.Runner.load`."""
        self.wait_for_save()
        started = time.time()
        rank = self.strategy.rank
        # a shardkit checkpoint, or a torch.distributed.checkpoint directory seen through the same reads
        with ckpt.open_checkpoint(path, verify=verify) as reader:
            for top, keys in getattr(reader, "unread", {}).items():
                self._logger.warning("checkpoint %s: %s (%d keys) has no shardkit counterpart and is not loaded",
                                     reader.path, top, len(keys))
            self._group_like(reader, state)
            values = StateSaver(self.strategy, self._owner_of).load(reader, state)
            if not runner_state:
                return values
            self.precision.load_state_dict(reader.read_json(_PRECISION_STATE, check=ckpt.check_precision_state))
            self._restore_step_state(reader.read_json(_RUNNER_STATE, check=ckpt.check_runner_state))
            rng_name = ckpt.rank_entry("rng", rank)
            if reader.has(rng_name):
                ckpt.restore_rng_state(reader.read_state(rng_name))
            else:
                self._logger.warning("checkpoint %s has no RNG state for rank %d (saved with %d ranks); "
                                     "random streams start fresh", reader.path, rank, reader.world_size)
        self._recovery.loaded(started, self._step_state()["optimizer_steps"])
        return values

    def _group_like(self, reader: Any, state: dict[str, Any]) -> None:
        """Tells a reader that keeps no param groups (torchtitan's DCP layout) those of each optimizer loaded."""
        regroup = getattr(reader, "regroup", None)
        for key, opt in state.items():
            if regroup is None or not isinstance(opt, torch.optim.Optimizer):
                continue
            names = {id(p): n for n, p in self.strategy.unwrap(self._owner_of(opt)).named_parameters()}
            groups = [[names.get(id(p)) for p in g["params"]] for g in opt.param_groups]
            if all(n is not None for g in groups for n in g):  # else (flat partitions) the saved guess stands
                regroup(key, groups)

    def resume(self, directory: str | Path, state: dict[str, Any], *, mode: bool | str = "auto",
               verify: bool = True) -> dict[str, Any] | None:
        """See :meth:`shardkit.Runner.resume`."""
        if mode not in (True, False, "auto"):
            raise ValueError(f"resume(mode={mode!r}): use 'auto' (the newest complete checkpoint when the launcher "
                             f"restarted the job), True (the newest complete checkpoint, which must exist) or False")
        if mode is False:
            return None
        # Rank 0 chooses for all: ranks that chose apart could load different steps (a folder not shared by every
        # machine then fails loudly at the load instead).
        found = newest_complete_checkpoint(directory) if self.strategy.is_global_zero else None
        chosen = self.strategy.broadcast(None if found is None else str(found), 0)
        path = None if chosen is None else Path(chosen)
        if mode == "auto" and not self._recovery.is_restart:
            if path is not None:
                self._logger.info("resume: %s holds checkpoints, but this is a first start, not a restart: training "
                                  "from the start (mode=True resumes from %s)", directory, path)
            return None
        if path is None:
            if mode is True:
                raise ckpt.CheckpointError(f"{directory}: no complete checkpoint to resume from (resume(mode=True)); "
                                           f"train from the start with mode='auto' or False, or name another folder")
            self._logger.info("resume: restarted, but %s holds no complete checkpoint yet: training from the start",
                              directory)
            return None
        self._logger.info("resume: loading %s, the newest complete checkpoint in %s", path, directory)
        return self.load(path, state, verify=verify)

    def close(self) -> None:
        """Finish the background save in flight (raising its error, if it failed) and stop its thread."""
        if self._background is not None:
            self._background.close()
