"""The training loss the Trainer logs: every step's exact loss over all ranks, gathered once per log.

Each optimizer step hands :meth:`LossTracker.add` this rank's share of the step's loss (the Trainer's
``training_step`` results summed over the accumulation window). With ``average_tokens_across_devices`` the
shares are normalised by the label items of the whole window on all ranks, so the step's loss is their sum
over ranks; without, each rank's share is its own mean and the step's loss is the mean over ranks. The
not-yet-gathered shares wait on the device and are reduced in one all-reduce at the next log.

The tracker saves its own state into checkpoints (:meth:`state_dict`): the losses since the last log and
the running total, so a resumed run's next log and its final ``train_loss`` equal the uninterrupted run's.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any

import torch

__all__ = ["LossTracker"]

logger = logging.getLogger("shardkit.trainer")


class LossTracker:
    """Per-step losses since the last log, and the total over the run (for ``train_loss``).

    Args:
        runner: the Trainer's Runner (its ``all_reduce``).
        average_tokens_across_devices: shares are normalised by the whole window's items on all ranks.
        nan_inf_filter: leave steps with a NaN/inf loss out of the logged mean (``logging_nan_inf_filter``).
    """

    def __init__(self, runner: Any, average_tokens_across_devices: bool, nan_inf_filter: bool):
        self.runner = runner
        self.average_tokens = average_tokens_across_devices
        self.nan_inf_filter = nan_inf_filter
        self.reset()

    def reset(self) -> None:
        """Forget everything: a new training run."""
        self._local: list[torch.Tensor] = []
        self._gathered: list[float] = []
        self.total, self.count = 0.0, 0
        self.last_logged: float | None = None

    def add(self, step_loss: torch.Tensor) -> None:
        """This rank's share of one optimizer step's loss (detached; stays on the device until the next log)."""
        self._local.append(step_loss.detach().float().reshape(()))

    @property
    def pending_steps(self) -> int:
        """Steps added since the last :meth:`log_value`."""
        return len(self._local) + len(self._gathered)

    def gather(self) -> list[float]:
        """Every pending step's loss over all ranks (one all-reduce for the steps not yet gathered)."""
        if self._local:
            stacked = torch.stack(self._local).to(torch.float64)
            world = self.runner.world_size
            if world > 1 and self.average_tokens:
                # Shares of the data-parallel ranks add up to the step's loss; ranks that share a batch (TP's,
                # a pipeline's stages) hold the same share, counted once: the sum over the world divided by the
                # world's replicas of each data-parallel rank (as the items count is).
                replicas = world / self.runner.strategy.data_parallel_size
                stacked = self.runner.all_reduce(stacked.to(self.runner.device), "sum") / replicas
            elif world > 1:
                stacked = self.runner.all_reduce(stacked.to(self.runner.device), "mean")
            self._gathered.extend(stacked.cpu().tolist())
            self._local = []
        return list(self._gathered)

    def log_value(self) -> float:
        """The mean loss of the steps since the last log (NaN/inf steps left out with the filter on); the
        steps then count into the total and the pending list empties."""
        losses = self.gather()
        finite = [v for v in losses if math.isfinite(v)]
        kept = finite if self.nan_inf_filter else losses
        if self.nan_inf_filter and len(finite) < len(losses):
            logger.warning(f"{len(losses) - len(finite)} of the last {len(losses)} steps had a NaN/inf loss; they "
                           "are left out of the logged loss (logging_nan_inf_filter=True)")
        self._gathered = []
        if not kept:  # every step since the last log was NaN/inf: the last value again (0 before any), warned above
            return self.last_logged if self.last_logged is not None else 0.0
        value = sum(kept) / len(kept)
        self.total += sum(kept)
        self.count += len(kept)
        self.last_logged = value
        return value

    def train_loss(self) -> float:
        """The mean loss over every step of the run so far (the pending steps included, without logging them)."""
        pending = [v for v in self.gather() if math.isfinite(v) or not self.nan_inf_filter]
        count = self.count + len(pending)
        return (self.total + sum(pending)) / count if count else float("nan")

    def state_dict(self) -> dict[str, Any]:
        """The pending losses and the running total (a collective: gathers the pending steps)."""
        return {"pending": [float(v) for v in self.gather()], "total": [self.total, self.count],
                "last": self.last_logged}

    def load_state_dict(self, saved: Any, where: str = "checkpoint") -> None:
        """Restore what :meth:`state_dict` saved; every value is checked (a checkpoint is hostile input).

        Raises:
            ValueError: a field of the wrong type or range, naming ``where`` and the field.
        """
        if not saved:
            self.reset()
            return
        if not isinstance(saved, dict):
            raise ValueError(f"{where}: tr_loss must be an object, got a {type(saved).__name__}")
        pending, total, last = saved.get("pending", []), saved.get("total", [0.0, 0]), saved.get("last")
        if not isinstance(pending, list) or not all(_real(v) for v in pending):
            raise ValueError(f"{where}: tr_loss.pending must be a list of numbers")
        if not (isinstance(total, list) and len(total) == 2 and _real(total[0]) and math.isfinite(total[0])
                and isinstance(total[1], int) and not isinstance(total[1], bool) and total[1] >= 0):
            raise ValueError(f"{where}: tr_loss.total must be [finite sum, step count >= 0]")
        if last is not None and not _real(last):
            raise ValueError(f"{where}: tr_loss.last must be a number or null")
        self._local, self._gathered = [], [float(v) for v in pending]
        self.total, self.count = float(total[0]), int(total[1])
        self.last_logged = None if last is None else float(last)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
