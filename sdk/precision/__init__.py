"""Precisions: which dtypes are used for parameters, compute and communication."""

from shardkit.precision.registry import PRECISIONS
from shardkit.utils.lazy import lazy_exports

__all__ = ["Precision", "FP32", "FP16", "BF16", "FP8", "PRECISIONS", "precision_from_name"]

# NOTE: the classes load on first use, so that the registry (`shardkit estimate-memory --help`'s --precision
# choices) does not import torch.
__getattr__, __dir__ = lazy_exports(__name__, {"Precision": "base", "BF16": "bf16", "FP8": "fp8", "FP16": "fp16",
                                               "FP32": "fp32"})

# A Precision from a name or alias ("fp32", "tf32", "fp16", "bf16", "bf16-true", "no", "16-mixed", ...) with the
# registry's defaults, then the keyword arguments. It IS the registry's builder, not a copy.
precision_from_name = PRECISIONS.build
