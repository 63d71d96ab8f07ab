"""Launcher helpers shared by the Triton ops."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Launch", "dtype_label", "empty_out", "finish_out", "meta"]

Launch = tuple[str, Callable[[], object]]
"""(label, call): one launch of a Triton kernel for scripts/check_triton.py (see ``OpSpec.triton_checks``)."""


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def empty_out(like: torch.Tensor, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Output buffer for a kernel that stores ``Y.dtype.element_ty``.

    NOTE: the triton 3.9 interpreter (CPU tensors, TRITON_INTERPRET=1) casts fp32 -> bf16/fp16 by truncating the
    mantissa, not round-to-nearest-even as the GPU does: 1 ulp = 0.0156 error at |y| ~ 2 in bf16, 8x torch's
    own rounding error. Interpreted launches therefore store fp32 and :func:`finish_out` rounds with torch.
    """
    dtype = like.dtype if dtype is None else dtype
    shape = like.shape if shape is None else shape
    store = torch.float32 if _interpreted(like) and dtype in (torch.bfloat16, torch.float16) else dtype
    return torch.empty(shape, dtype=store, device=like.device)


def finish_out(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast an :func:`empty_out` buffer to ``dtype`` (a no-op on GPU)."""
    return buf if buf.dtype == dtype else buf.to(dtype)


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor without storage: scripts/check_triton.py compiles launches on these, nothing is run."""
    return torch.empty(*shape, dtype=dtype, device="meta")


def dtype_label(dtype: torch.dtype) -> str:
    """fp32, bf16, fp16: the short dtype names of the compile-check labels."""
    return str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
