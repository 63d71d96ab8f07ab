"""Precisions: which dtypes are used for parameters, compute and communication."""

from shardkit.precision.base import Precision
from shardkit.precision.bf16 import BF16
from shardkit.precision.fp8 import FP8
from shardkit.precision.fp16 import FP16
from shardkit.precision.fp32 import FP32
from shardkit.precision.registry import PRECISIONS

__all__ = ["Precision", "FP32", "FP16", "BF16", "FP8", "PRECISIONS", "precision_from_name"]


# A Precision from a name or alias ("fp32", "tf32", "fp16", "bf16", "bf16-true", "no", "16-mixed", ...) with the
# registry's defaults, then the keyword arguments. It IS the registry's builder, not a copy.
precision_from_name = PRECISIONS.build
