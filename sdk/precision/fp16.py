"""fp16 mixed precision with dynamic loss scaling (DeepSpeed's knobs, names and defaults)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from typing_extensions import override

from shardkit.precision.base import LossScaling, Precision, parse_dtype

__all__ = ["FP16", "LossScaler"]

log = logging.getLogger("shardkit.precision")


class LossScaler:
    """Dynamic loss scale with hysteresis, as DeepSpeed's ``DynamicLossScaler`` behaves.

    On an overflow the step is skipped; the scale halves once ``hysteresis`` overflows have been
    seen since the last good window (never below ``min_loss_scale``). After ``loss_scale_window``
    steps in a row without overflow the scale doubles and the hysteresis budget refills. ``stuck_steps``
    overflows in a row at ``min_loss_scale`` warn once (the run is skipping every step and learns nothing).
    """

    # DeepSpeed raises at the minimum (raise_error_at_min_scale); warning after a few skipped steps in a row lets a
    # transient spike pass and still names a run that has stopped learning.
    STUCK_STEPS = 10

    def __init__(self, initial_scale: float, window: int, hysteresis: int, min_scale: float, dynamic: bool,
                 stuck_steps: int = STUCK_STEPS):
        self.scale = float(initial_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.dynamic = dynamic
        self.hysteresis_left = hysteresis
        self.good_steps = 0
        self.skipped_steps = 0
        self.stuck_steps = stuck_steps
        self.overflows_at_min = 0  # overflows in a row with the scale at its minimum

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            if overflow:
                self.skipped_steps += 1
            return
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            old = self.scale
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            log.warning("fp16 overflow: skipped the optimizer step; loss scale %g -> %g", old, self.scale)
            self._check_stuck(old)
            return
        self.overflows_at_min = 0
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2.0
            self.hysteresis_left = self.hysteresis

    def _check_stuck(self, old: float) -> None:
        self.overflows_at_min = self.overflows_at_min + 1 if old <= self.min_scale else 0
        if self.overflows_at_min == self.stuck_steps:
            log.warning(
                "fp16 loss scale stuck at its minimum (min_loss_scale=%g) for %d overflowing steps in a row: every "
                "optimizer step is skipped and the model is not training. The gradients overflow fp16 even unscaled "
                "(or the loss is inf/NaN): check the loss and the data, lower the learning rate, or train in bf16 "
                "(precision=BF16(), DeepSpeed's \"bf16\": {\"enabled\": true})", self.min_scale, self.stuck_steps)

    def state_dict(self) -> dict[str, Any]:
        keys = ("scale", "hysteresis_left", "good_steps", "skipped_steps")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class FP16(Precision):
    """fp32 master parameters, fp16 compute under autocast, dynamic loss scaling.

    Args:
        initial_scale_power: the first scale is ``2**initial_scale_power``.
        loss_scale_window: good steps in a row before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_loss_scale: the scale never drops below this.
        loss_scale: a value > 0 fixes the scale (static scaling); 0 means dynamic.
        comm_dtype: dtype of gradient reduction across ranks (fp32 by default).
    """

    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    loss_scale: float = 0.0
    comm_dtype: torch.dtype | str = torch.float32
    compute_dtype: torch.dtype = field(default=torch.float16, init=False)
    _scaler: LossScaler = field(init=False, repr=False)
    _unscaled: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.comm_dtype = parse_dtype(self.comm_dtype, "FP16.comm_dtype")
        if self.loss_scale < 0:
            raise ValueError(f"FP16.loss_scale={self.loss_scale} must be >= 0 (0 = dynamic scaling)")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(
                f"FP16 needs loss_scale_window >= 1 and hysteresis >= 1, got {self.loss_scale_window} and "
                f"{self.hysteresis}"
            )
        dynamic = self.loss_scale == 0
        initial = 2.0**self.initial_scale_power if dynamic else self.loss_scale
        self._scaler = LossScaler(initial, self.loss_scale_window, self.hysteresis, self.min_loss_scale, dynamic)

    @property
    @override
    def current_loss_scale(self) -> float:
        return self._scaler.scale

    @override
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scaler.scale

    @override
    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self._unscaled:
            return
        inv = 1.0 / self._scaler.scale
        grads = _local_grads(optimizer)
        if grads:
            torch._foreach_mul_(grads, inv)
        self._unscaled = True

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, found_inf: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> bool:
        self.unscale_gradients(optimizer)
        self._unscaled = False
        overflow = _has_inf_or_nan(optimizer)
        if found_inf is not None:
            overflow = found_inf(overflow)
        skipped = bool(overflow.item())
        if not skipped:
            optimizer.step()
        self._scaler.update(skipped)
        return not skipped

    @property
    @override
    def loss_scaling(self) -> LossScaling:
        return LossScaling(self.loss_scale, self.initial_scale_power, self.loss_scale_window, self.hysteresis,
                           self.min_loss_scale)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self._scaler.state_dict()}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loss_scaler" in state:
            self._scaler.load_state_dict(state["loss_scaler"])

    @override
    def follow_engine_step(self, scale: float | None, skipped: bool) -> None:
        if scale is not None:
            self._scaler.scale = float(scale)
        if skipped:
            self._scaler.skipped_steps += 1

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps were skipped for overflow so far."""
        return self._scaler.skipped_steps


def _local_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every gradient as the plain tensor this rank holds.

    Tensor parallelism leaves DTensor gradients (the sharded Linears) beside plain ones (norms, embeddings),
    and the foreach ops refuse such a mix; each rank's local part is what it unscales and checks, and the
    strategy's found_inf reduction makes the verdict global.
    """
    grads = []
    with torch.no_grad():  # to_local() is then the shard itself, so in-place unscaling reaches the gradient
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return grads


def _has_inf_or_nan(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    grads = _local_grads(optimizer)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # One fused pass: the sum of a tensor is non-finite iff some element is inf or NaN (or it overflows).
    total = torch.stack(torch._foreach_norm(grads, 1.0)).float().sum()
    return (~torch.isfinite(total)).float()
