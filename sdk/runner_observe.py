"""The Runner's observability wiring: trackers, the step profiler, throughput and MFU (a mixin of :class:`Runner`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardkit.observability import RunLog, StepProfiler, Throughput, install_oom_snapshot
from shardkit.tracking import TrackerSpec

__all__ = ["RunnerObservability"]


class RunnerObservability:
    """What the run is doing: ``log_with`` trackers, ``profile_steps``, ``runner.throughput``."""

    def _observe(self, log_with: Any, logging_dir: str | Path, profile_steps: Any) -> None:
        specs = tuple(self.config.trackers) if self.config is not None else ()
        given = [] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
        self.logging_dir = Path(logging_dir)
        items = given + list(specs)
        # DeepSpeed's monitor sections (TrackerSpec, from this config or a front's) also get its per-step records.
        monitor = any(isinstance(item, TrackerSpec) for item in items)
        self.run_log = RunLog(items, self.logging_dir, "shardkit", self.is_main_process, monitor=monitor)
        self.profiler = None if profile_steps is None else StepProfiler(
            profile_steps, self.logging_dir / "profile", self.rank, self.is_main_process)
        if self.profiler is not None:
            install_oom_snapshot(self.logging_dir / "profile", self.rank)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        scale = self.precision.current_loss_scale if self.precision.loss_scaling is not None else None
        # DeepSpeed's monitor counts samples: micro-batches of micro_batch_size on every data-parallel rank.
        micro = getattr(self.config, "micro_batch_size", None) or 1
        samples = (self.optimizer_steps * self.gradient_accumulation_steps * micro
                   * self.strategy.data_parallel_size)
        self.run_log.on_step(optimizer, scale, samples)
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
                checkpointed=bool(self.activation_checkpointing))
        return self._throughput

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Record metrics with the ``log_with`` trackers on the main process (``step``: the optimizer step)."""
        self.run_log.log(values, self.optimizer_steps if step is None else step)

    def log_hyperparams(self, values: dict[str, Any]) -> None:
        """Record the run's configuration once with the ``log_with`` trackers on the main process."""
        self.run_log.log_hyperparams(values)
