"""FP8 training: bf16 mixed precision with the linear layers' matmuls in float8 (torchao's float8 linear).

Every eligible ``nn.Linear`` becomes torchao's ``Float8Linear`` with dynamic (per-tensor, computed each step)
scaling: inputs, weights and output gradients are cast to e4m3/e5m2 for the three GEMMs, everything else runs
as under :class:`~shardkit.precision.BF16`. FP8 tensor cores exist from compute capability 8.9 (Ada, Hopper);
elsewhere, and on CPU, the precision refuses by name instead of running emulated or failing inside a GEMM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from typing_extensions import override

from shardkit.precision.bf16 import BF16

__all__ = ["FP8", "fp8_supported"]

_MIN_CAPABILITY = (8, 9)
# torch._scaled_mm needs both GEMM dims of every operand to be multiples of 16
_ALIGN = 16


def fp8_supported(device: torch.device | str) -> str | None:
    """None when ``device`` can train in FP8, else the reason it cannot (names the device and the fix)."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"FP8 training needs an NVIDIA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, "
                f"Hopper, Blackwell); the run's device is {device.type!r}. Use precision 'bf16' here.")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < _MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"FP8 training needs FP8 tensor cores (compute capability >= 8.9); {name} is {major}.{minor}. "
                "Use precision 'bf16' on this GPU.")
    if importlib.util.find_spec("torchao") is None:
        return "FP8 training uses torchao's float8 linear: `pip install torchao` (0.18 works with torch 2.13)."
    return None


@dataclass(frozen=True)
class FP8(BF16):
    """bf16 mixed precision with float8 matmuls in the linear layers (torchao, dynamic tensorwise scaling).

    Args:
        skip: module names (suffixes of the qualified name) left in bf16; the LM head by default, whose
            logits feed the loss directly and are the usual accuracy casualty of FP8.
        comm_dtype: dtype of gradient reduction across ranks (as :class:`BF16`).
    """

    skip: Sequence[str] = ("lm_head",)

    @override
    def setup_environment(self, device: torch.device) -> None:
        reason = fp8_supported(device)
        if reason is not None:
            raise RuntimeError(f"precision FP8: {reason}")

    def eligible(self, fqn: str, module: torch.nn.Module) -> bool:
        """Whether the linear ``module`` named ``fqn`` is converted: both dims multiples of 16, not skipped."""
        if not isinstance(module, torch.nn.Linear):
            return False
        if any(fqn == s or fqn.endswith("." + s) for s in self.skip):
            return False
        return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Swap the eligible ``nn.Linear`` layers for torchao ``Float8Linear`` (dynamic scaling), in place."""
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as exc:
            raise RuntimeError("precision FP8 uses torchao's float8 linear: `pip install torchao` "
                               f"(0.18 works with torch 2.13); importing it failed: {exc}") from exc
        module = super().convert_module(module)
        return convert_to_float8_training(module, config=Float8LinearConfig(),
                                          module_filter_fn=lambda m, fqn: self.eligible(fqn, m))
