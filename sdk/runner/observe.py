"""The Runner's observability, as an object the Runner holds: trackers, the step profiler, throughput and MFU, and
out-of-memory reports."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.config.common import precision_kind
from shardkit.observability import RunLog, StepProfiler, Throughput, install_oom_snapshot
from shardkit.observability.oom_report import StepRecorder, install_oom_excepthook, is_out_of_memory, write_oom_report
from shardkit.observability.trackers import TrackerSpec
from shardkit.precision import Precision
from shardkit.runner.assembly import count_parameters
from shardkit.runner.recovery import RunRecovery
from shardkit.strategies.base import Strategy

__all__ = ["RunnerObservability"]

_log = logging.getLogger("shardkit")


class RunnerObservability:
    """What the run is doing: ``log_with`` trackers, ``profile_steps``, throughput, out-of-memory reports.

    It owns the run log, the profiler, the flight recorder of the last steps and the throughput meter, and is
    handed the strategy and precision (ranks, dtypes), the config (its DeepSpeed monitor sections and micro-batch
    size) and ``model``, the model set up (None before setup), which sizes the run for an out-of-memory report's
    ``estimate-memory`` command.
    The arguments are the Runner's of the same names.
    """

    def __init__(self, strategy: Strategy, precision: Precision, config: Any, *, log_with: Any,
                 logging_dir: str | Path, profile_steps: Any, memory_snapshot: bool, peak_tflops: float | None,
                 model: Callable[[], nn.Module | None]):
        self.strategy = strategy
        self.precision = precision
        self._config = config
        self._peak_tflops = peak_tflops
        self._model = model
        rank, main = strategy.rank, strategy.is_global_zero
        specs = tuple(config.trackers) if config is not None else ()
        given = [] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
        self.logging_dir = Path(logging_dir)
        items = given + list(specs)
        # DeepSpeed's monitor sections (TrackerSpec, from this config or a front's) also get its per-step records.
        monitor = any(isinstance(item, TrackerSpec) for item in items)
        self.run_log = RunLog(items, self.logging_dir, "shardkit", main, monitor=monitor)
        self.profiler = None if profile_steps is None else StepProfiler(
            profile_steps, self.logging_dir / "profile", rank, main)
        self.flight_recorder = StepRecorder()
        self._oom_snapshot: Path | None = None
        self._oom_retrying = False
        self._throughput: Throughput | None = None
        if self.profiler is not None or memory_snapshot:
            if install_oom_snapshot(self.logging_dir / "profile", rank) is not None:
                self._oom_snapshot = self.logging_dir / "profile" / f"oom_snapshot.rank{rank}.pickle"
        install_oom_excepthook(self.report_oom)
        # under `shardkit launch --max-restarts`: progress for the launcher, the time each failure cost
        self.recovery = RunRecovery(rank, strategy.local_rank == 0, self.log, _log)

    # ---- out-of-memory reports ----------------------------------------------------------------

    def report_oom(self, exc: BaseException) -> Path | None:
        """See :meth:`shardkit.Runner.report_oom`."""
        if not is_out_of_memory(exc):
            return None
        done = getattr(exc, "_shardkit_oom_report", None)
        if done is not None:
            return done
        path = write_oom_report(exc, self.logging_dir, self.strategy.rank, self.flight_recorder, self.run_facts(),
                                self._oom_snapshot)
        with contextlib.suppress(AttributeError, TypeError):
            exc._shardkit_oom_report = path
        return path

    def run_facts(self) -> dict[str, Any] | None:
        """The run's size for the estimate-memory command; None before setup() (or when it cannot be counted)."""
        module = self._model()
        if module is None:
            return None
        try:
            params = count_parameters(self.strategy, module)
        except Exception:  # noqa: BLE001 - counting must not hide the out-of-memory error being reported
            return None
        world = self.strategy.world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return {"params": params, "precision": precision_kind(self.precision), "nproc_per_node": local,
                "nodes": max(1, world // max(local, 1))} if params > 0 else None

    @contextlib.contextmanager
    def retrying_oom(self) -> Iterator[None]:
        """See :meth:`shardkit.Runner.retrying_oom`."""
        previous, self._oom_retrying = self._oom_retrying, True
        try:
            yield
        finally:
            self._oom_retrying = previous

    @contextlib.contextmanager
    def reporting_oom(self) -> Iterator[None]:
        """Write the report for an out-of-memory error raised inside (unless :meth:`retrying_oom`), then re-raise."""
        try:
            yield
        except BaseException as exc:
            if not self._oom_retrying:
                try:
                    self.report_oom(exc)
                except Exception as failed:  # noqa: BLE001 - a full disk must not replace the out-of-memory error
                    _log.warning("shardkit: could not write the out-of-memory report: %s: %.200s",
                                 type(failed).__name__, failed)
            raise

    # ---- per step -----------------------------------------------------------------------------

    def before_backward(self, loss: torch.Tensor, micro_step: int, optimizer_steps: int) -> None:
        """A micro-batch's loss is about to go backward (``micro_step``: its place in the window)."""
        if self.profiler is not None and micro_step == 0:
            self.profiler.before_step(optimizer_steps)
        self.run_log.on_backward(loss)
        self.flight_recorder.on_backward(loss)

    def after_step(self, optimizer: torch.optim.Optimizer, optimizer_steps: int, accumulation_steps: int) -> None:
        """The optimizer step numbered ``optimizer_steps`` ended (or was skipped)."""
        scale = self.precision.current_loss_scale if self.precision.loss_scaling is not None else None
        # DeepSpeed's monitor counts samples: micro-batches of micro_batch_size on every data-parallel rank.
        micro = getattr(self._config, "micro_batch_size", None) or 1
        samples = optimizer_steps * accumulation_steps * micro * self.strategy.data_parallel_size
        self.run_log.on_step(optimizer, scale, samples)
        self.flight_recorder.on_step(optimizer_steps)
        self.recovery.after_step(optimizer_steps)
        if self.profiler is not None:
            self.profiler.after_step(optimizer_steps - 1)

    # ---- throughput and trackers --------------------------------------------------------------

    def restart_throughput(self) -> None:
        """A new model was set up: the next :meth:`throughput` is measured for it, timed from now."""
        self._throughput = None

    def throughput(self, model: Callable[[], nn.Module], checkpointed: bool) -> Throughput:
        """The throughput meter of the model set up (``model()`` returns the user's module, asked on first use)."""
        if self._throughput is None:
            strategy = self.strategy
            self._throughput = Throughput(
                model(), strategy.root_device, self.precision.compute_dtype,
                data_parallel_size=strategy.data_parallel_size, world_size=strategy.world_size,
                checkpointed=checkpointed, peak=self._peak_tflops, numel=strategy.parameter_numel,
                announce=strategy.is_global_zero)
        return self._throughput

    def log(self, values: dict[str, Any], step: int) -> None:
        self.run_log.log(values, step)

    def log_hyperparams(self, values: dict[str, Any]) -> None:
        self.run_log.log_hyperparams(values)

    def finish(self) -> None:
        """Write the profiler's last files and close the trackers."""
        if self.profiler is not None:
            self.profiler.finish()
        self.run_log.finish()
