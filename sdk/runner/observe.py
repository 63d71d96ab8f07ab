"""The Runner's observability wiring: trackers, the step profiler, throughput and MFU (a mixin of :class:`Runner`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardkit.config.common import precision_kind
from shardkit.observability import RunLog, StepProfiler, Throughput, install_oom_snapshot
from shardkit.observability.oom_report import StepRecorder, install_oom_excepthook, is_out_of_memory, write_oom_report
from shardkit.observability.trackers import TrackerSpec

__all__ = ["RunnerObservability"]

_log = logging.getLogger("shardkit")


class RunnerObservability:
    """What the run is doing: ``log_with`` trackers, ``profile_steps``, ``runner.throughput``, out-of-memory reports."""

    def _observe(self, log_with: Any, logging_dir: str | Path, profile_steps: Any, memory_snapshot: bool,
                 peak_tflops: float | None = None) -> None:
        self._peak_tflops = peak_tflops
        specs = tuple(self.config.trackers) if self.config is not None else ()
        given = [] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
        self.logging_dir = Path(logging_dir)
        items = given + list(specs)
        # DeepSpeed's monitor sections (TrackerSpec, from this config or a front's) also get its per-step records.
        monitor = any(isinstance(item, TrackerSpec) for item in items)
        self.run_log = RunLog(items, self.logging_dir, "shardkit", self.is_main_process, monitor=monitor)
        self.profiler = None if profile_steps is None else StepProfiler(
            profile_steps, self.logging_dir / "profile", self.rank, self.is_main_process)
        self.flight_recorder = StepRecorder()
        self._oom_snapshot = None
        self._oom_retrying = False
        if self.profiler is not None or memory_snapshot:
            if install_oom_snapshot(self.logging_dir / "profile", self.rank) is not None:
                self._oom_snapshot = self.logging_dir / "profile" / f"oom_snapshot.rank{self.rank}.pickle"
        install_oom_excepthook(self.report_oom)

    def report_oom(self, exc: BaseException) -> Path | None:
        """Write ``<logging_dir>/oom_report.rank<N>.json`` for an out-of-memory error (once per error): the failing
        allocation, the memory summary, the last steps and the ``shardkit estimate-memory`` command for this run.
        Runs by itself for an error raised inside ``backward``/``step`` or one that ends the script; call it from
        a loop that catches the error to retry smaller. Returns the report's path (None for another error)."""
        if not is_out_of_memory(exc):
            return None
        done = getattr(exc, "_shardkit_oom_report", None)
        if done is not None:
            return done
        path = write_oom_report(exc, self.logging_dir, self.rank, self.flight_recorder, self._run_facts(),
                                self._oom_snapshot)
        with contextlib.suppress(AttributeError, TypeError):
            exc._shardkit_oom_report = path
        return path

    def _run_facts(self) -> dict[str, Any] | None:
        """The run's size for the estimate-memory command; None before setup() (or when it cannot be counted)."""
        if self._module is None:
            return None
        try:
            params = self.num_parameters(self._module)
        except Exception:  # noqa: BLE001 - counting must not hide the out-of-memory error being reported
            return None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        return {"params": params, "precision": precision_kind(self.precision), "nproc_per_node": local,
                "nodes": max(1, self.world_size // max(local, 1))} if params > 0 else None

    @contextlib.contextmanager
    def retrying_oom(self) -> Iterator[None]:
        """Out-of-memory errors inside are the caller's to retry smaller (the Trainer's ``auto_find_batch_size``):
        ``backward``/``step`` write no report for them. One that escapes and ends the script is still reported."""
        previous, self._oom_retrying = self._oom_retrying, True
        try:
            yield
        finally:
            self._oom_retrying = previous

    @contextlib.contextmanager
    def _reporting_oom(self) -> Iterator[None]:
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

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        scale = self.precision.current_loss_scale if self.precision.loss_scaling is not None else None
        # DeepSpeed's monitor counts samples: micro-batches of micro_batch_size on every data-parallel rank.
        micro = getattr(self.config, "micro_batch_size", None) or 1
        samples = (self.optimizer_steps * self.gradient_accumulation_steps * micro
                   * self.strategy.data_parallel_size)
        self.run_log.on_step(optimizer, scale, samples)
        self.flight_recorder.on_step(self.optimizer_steps)
        if self.profiler is not None:
            self.profiler.after_step(self.optimizer_steps - 1)

    # ---- what the run is doing ----------------------------------------------------------------

    @property
    def throughput(self) -> Throughput:
        """Tokens/s, samples/s, TFLOP/s and MFU of the model set up: ``runner.throughput.update(tokens, samples)``
        after each step returns them (see :class:`shardkit.observability.Throughput`); timing starts at setup()."""
        if self._throughput is None:
            module = self._require("_module", "throughput")
            self._throughput = Throughput(
                self.unwrap_model(module), self.device, self.precision.compute_dtype,
                data_parallel_size=self.strategy.data_parallel_size, world_size=self.world_size,
                checkpointed=bool(self.activation_checkpointing), peak=self._peak_tflops,
                numel=self.strategy.parameter_numel, announce=self.is_main_process)
        return self._throughput

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Record metrics with the ``log_with`` trackers on the main process (``step``: the optimizer step)."""
        self.run_log.log(values, self.optimizer_steps if step is None else step)

    def log_hyperparams(self, values: dict[str, Any]) -> None:
        """Record the run's configuration once with the ``log_with`` trackers on the main process."""
        self.run_log.log_hyperparams(values)
