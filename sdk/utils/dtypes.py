"""Short dtype names ("bf16"), the spelling DeepSpeed's JSON, Accelerate's YAML and shardkit's reprs use.

The safetensors tags a checkpoint stores ("BF16") are a different vocabulary; they live in
:mod:`shardkit.checkpoint.format` (``dtype_tag``).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "dtype_name"]

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def dtype_name(dtype: torch.dtype, where: str = "") -> str:
    """``torch.bfloat16`` -> ``"bf16"``.

    Args:
        dtype: one of float32, float16, bfloat16 (the dtypes a precision can use).
        where: what holds the dtype, named in the error (e.g. ``"BF16.comm_dtype"``).

    Raises:
        ValueError: any other dtype, naming ``where`` and the dtypes that have a short name.
    """
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}dtype {dtype} has no short name; use one of "
                         f"{', '.join(str(d) for d in DTYPE_NAMES)}") from None
