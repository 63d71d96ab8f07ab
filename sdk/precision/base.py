"""The Precision base: which dtypes are used where, and the hooks a strategy calls around a step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardkit.utils.dtypes import dtype_name  # re-exported: the one definition lives in shardkit.utils.dtypes

__all__ = ["Precision", "LossScaling", "dtype_name", "parse_dtype"]

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype | None, field: str) -> torch.dtype | None:
    """Accept ``torch.bfloat16`` or a name such as ``"bf16"``; name the field on a bad value."""
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"{field}={value!r} is not a dtype; use one of {sorted(set(_DTYPES))}") from None


@dataclass(frozen=True)
class LossScaling:
    """Loss scaling settings, static or dynamic (the names and meaning DeepSpeed's scaler uses too).

    Args:
        loss_scale: a value > 0 fixes the scale (static scaling); 0 means dynamic.
        initial_scale_power: the first dynamic scale is ``2**initial_scale_power``.
        loss_scale_window: good steps in a row before the scale doubles.
        hysteresis: overflows tolerated before the scale halves.
        min_loss_scale: the scale never drops below this.
    """

    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float


class Precision:
    """Says which dtypes a run uses and wraps the parts of a step that depend on them.

    ``param_dtype`` is the dtype parameters are stored and updated in, ``compute_dtype`` the dtype
    the forward runs in (through autocast when it differs), and ``comm_dtype`` the dtype gradients
    are reduced in across ranks. The communication dtype is its own setting: it is never derived
    from the parameter dtype. Strategies ask a precision for these facts; they never switch on its
    class.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    comm_dtype: torch.dtype = torch.float32

    # ---- environment and modules -------------------------------------------------------------

    def setup_environment(self, device: torch.device) -> None:
        """Called once the device is known (FP32 toggles TF32 here)."""

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast a module's parameters to ``param_dtype`` (a no-op unless parameters are low precision)."""
        if self.param_dtype != torch.float32:
            module = module.to(self.param_dtype)
        return module

    def module_init_context(self) -> contextlib.AbstractContextManager:
        """Context under which modules are built (makes new tensors ``param_dtype``)."""
        return _default_dtype(self.param_dtype)

    @property
    def uses_autocast(self) -> bool:
        """True when the forward runs in a lower dtype than the parameters are stored in."""
        return self.compute_dtype != self.param_dtype

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Autocast to ``compute_dtype`` on ``device``, or a null context where none is needed."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    # ---- backward and step --------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Multiply the loss before backward (loss scaling); identity by default."""
        return loss

    @property
    def current_loss_scale(self) -> float:
        """The current loss scale (1.0 where there is no scaling)."""
        return 1.0

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale, once per step (before clipping or the step)."""

    def follow_engine_step(self, scale: float | None, skipped: bool) -> None:
        """Where an engine scales the loss itself (DeepSpeed), the step it just took: ``scale`` its loss scale now
        (None: it has none), ``skipped`` whether it skipped the step. Keeps ``current_loss_scale`` (what the Runner
        logs) and the saved scaler state true to the engine's; a no-op for precisions that do not scale."""

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, found_inf: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> bool:
        """Run ``optimizer.step()``; return False where the step was skipped (FP16 overflow).

        Args:
            optimizer: the optimizer to step.
            found_inf: reduces a local 0/1 overflow flag across the ranks that hold gradient shards,
                so that every rank skips together. Unused by precisions that never skip.
        """
        optimizer.step()
        return True

    # ---- loss scaling -------------------------------------------------------------------------

    @property
    def loss_scaling(self) -> LossScaling | None:
        """The loss-scale settings, for strategies whose engine scales the loss itself; None: no scaling."""
        return None

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain-value state to checkpoint (the loss scaler's, for FP16)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        names = ("param_dtype", "compute_dtype", "comm_dtype")
        fields = ", ".join(f"{k}={dtype_name(getattr(self, k))}" for k in names)
        return f"{type(self).__name__}({fields})"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
