"""The Runner's experiment trackers: ``Runner(log_with=...)``, ``runner.log(...)``, ``runner.log_hyperparams(...)``.

Trackers come from :data:`~shardkit.observability.trackers.TRACKERS` (the registry every front shares) and are
built on the main
process only, at the first record, so that the other ranks never import a tracker's package. A DeepSpeed config's
``tensorboard`` / ``wandb`` / ``csv_monitor`` sections become the same trackers, and then, as DeepSpeed's monitor
does, the Runner records the training loss, the learning rate and (FP16) the loss scale at every optimizer step
under DeepSpeed's names (``Train/Samples/train_loss`` ...), with the number of samples trained as the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardkit.observability.trackers import Tracker, TrackerSpec, build_trackers

__all__ = ["RunLog"]


class RunLog:
    """Trackers of one run, on the main process.

    Args:
        log_with: tracker names (``"all"``), :class:`~shardkit.observability.trackers.TrackerSpec`, tracker objects,
                or a list.
        logging_dir: where the trackers named by a string write.
        run_name: the run (W&B project, MLflow experiment, the TensorBoard/CSV sub-directory).
        is_main_process: only the main process builds and writes trackers.
        monitor: record the loss, learning rate and loss scale at each step, as DeepSpeed's monitor does.
    """

    def __init__(self, log_with: Any, logging_dir: str | Path, run_name: str, is_main_process: bool,
                 monitor: bool = False) -> None:
        self.log_with = log_with
        self.logging_dir, self.run_name = Path(logging_dir), run_name
        self.active = bool(log_with) and is_main_process
        self.monitor = monitor and self.active
        self._trackers: list[Tracker] | None = None
        self._losses: list[torch.Tensor] = []

    @classmethod
    def from_config(cls, specs: tuple[TrackerSpec, ...], is_main_process: bool) -> RunLog:
        """The trackers of a DeepSpeed config's monitor sections, with DeepSpeed's per-step records."""
        return cls(list(specs), ".", "shardkit", is_main_process, monitor=True)

    @property
    def trackers(self) -> list[Tracker]:
        """The trackers, built on first use (empty on other processes and without ``log_with``)."""
        if self._trackers is None:
            self._trackers = build_trackers(self.log_with, self.run_name, self.logging_dir) if self.active else []
        return self._trackers

    def log_hyperparams(self, values: dict[str, Any]) -> None:
        """Record the run's configuration once, with every tracker."""
        for tracker in self.trackers:
            tracker.store_init_configuration(dict(values))

    def log(self, values: dict[str, Any], step: int | None) -> None:
        """Record ``values`` at ``step`` with every tracker."""
        for tracker in self.trackers:
            tracker.log(dict(values), step=step)

    # ---- DeepSpeed's monitor ------------------------------------------------------------------------

    def on_backward(self, loss: torch.Tensor) -> None:
        if self.monitor:
            self._losses.append(loss.detach())

    def on_step(self, optimizer: Any, loss_scale: float | None, samples: int) -> None:
        """After an optimizer step: the window's mean loss, the learning rate and the loss scale at ``samples``."""
        if not self.monitor or not self._losses:
            return
        loss = torch.stack([x.float().reshape(()) for x in self._losses]).mean().item()
        self._losses.clear()
        values = {"Train/Samples/train_loss": loss}
        if optimizer is not None and optimizer.param_groups:
            values["Train/Samples/lr"] = float(optimizer.param_groups[0]["lr"])
        if loss_scale is not None:
            values["Train/Samples/loss_scale"] = float(loss_scale)
        self.log(values, step=samples)

    def finish(self) -> None:
        """Flush and close every tracker."""
        for tracker in self._trackers or []:
            tracker.finish()
        self._trackers = None
