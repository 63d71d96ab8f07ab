"""Tokens/s, model TFLOP/s and MFU of the Trainer's logging windows (``runner.throughput``).

The rates go to the reporters (``report_to``) with each training log, never into ``state.log_history``: timing
differs from run to run, and a resumed run's history must equal the uninterrupted one's (as Hugging Face's does).
Evaluations and checkpoint saves between steps are not counted as training time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["StepRates"]


class StepRates:
    """Counts the tokens and samples a rank trains between two logs, and the training time they took.

    Args:
        runner: the Trainer's Runner (its ``throughput`` gives the FLOPs per token and the device's peak).
        input_name: the batch key of the token ids (the model's ``main_input_name``).
    """

    def __init__(self, runner: Any, input_name: str = "input_ids"):
        self.runner, self.input_name = runner, input_name
        self.start()

    def start(self) -> None:
        """Begin a window now (the start of training)."""
        self._tokens = self._samples = 0
        self._seconds, self._mark = 0.0, time.perf_counter()

    def add(self, window: list[Any]) -> None:
        """Count the batches of one optimizer step (padding included: it is computed on)."""
        for batch in window:
            ids = batch.get(self.input_name) if isinstance(batch, Mapping) else None
            if isinstance(ids, torch.Tensor) and ids.ndim:
                self._tokens += ids.numel()
                self._samples += ids.shape[0]

    def pause(self) -> None:
        """Stop the clock (an evaluation or a save begins)."""
        self._seconds += time.perf_counter() - self._mark

    def resume(self) -> None:
        """Restart the clock after :meth:`pause`."""
        self._mark = time.perf_counter()

    def take(self) -> dict[str, float]:
        """The window's ``tokens_per_s``, ``tflops``, ``mfu`` (and ``hfu`` under activation checkpointing), then a
        new window; empty when its batches held no token ids. Call after the loss is read (the device is synced)."""
        self.pause()
        tokens, samples, seconds = self._tokens, self._samples, self._seconds
        self.start()
        if not tokens:
            return {}
        rates = self.runner.throughput.update(tokens, samples, seconds)
        return {k: round(rates[k], 6) for k in ("tokens_per_s", "tflops", "mfu", "hfu") if k in rates}
