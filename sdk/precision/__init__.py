"""Precisions: which dtypes are used for parameters, compute and communication."""

from shardkit.precision.base import Precision
from shardkit.precision.bf16 import BF16
from shardkit.precision.fp16 import FP16
from shardkit.precision.fp32 import FP32
from shardkit.precision.registry import PRECISIONS

__all__ = ["Precision", "FP32", "FP16", "BF16", "PRECISIONS", "precision_from_name"]


def precision_from_name(name: str, **kwargs) -> Precision:
    """A Precision from a name or alias in :data:`PRECISIONS` ("fp32", "tf32", "fp16", "bf16", "bf16-true",
    "no", "16-mixed", "bf16-mixed", ...), with its defaults and then ``kwargs``.

    Raises:
        ValueError: an unknown name (with the closest known one and the list of names).
    """
    return PRECISIONS.build(name, **kwargs)
