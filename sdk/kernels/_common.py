"""Launcher helpers shared by the Triton ops."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import triton
import triton.language as tl

from shardkit.utils.suggest import did_you_mean

__all__ = ["Launch", "LaunchConfig", "dtype_label", "empty_out", "finish_out", "meta", "round_like", "softcap_tanh"]

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


@triton.jit
def round_like(x, ptr):
    """fp32 ``x`` converted to ``ptr``'s element type, rounding to nearest even as torch's ``.to()`` does.

    bf16 by hand: the interpreter's fp32 -> bf16 cast truncates (see :func:`empty_out`); nan never occurs here
    unless the inputs hold one. Other types: the plain cast (round to nearest even on GPU and in numpy).
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(ptr.dtype.element_ty)


def finish_out(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast an :func:`empty_out` buffer to ``dtype`` (a no-op on GPU)."""
    return buf if buf.dtype == dtype else buf.to(dtype)


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor without storage: scripts/check_triton.py compiles launches on these, nothing is run."""
    return torch.empty(*shape, dtype=dtype, device="meta")


def dtype_label(dtype: torch.dtype) -> str:
    """fp32, bf16, fp16: the short dtype names of the compile-check labels."""
    return str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")


class LaunchConfig:
    """Launch settings of one Triton op that a tuning sweep may override (``benchmarks/gpu_tune.py``).

    Every setting is ``None`` by default, meaning the op's own heuristic; :meth:`override` sets some of them
    for the duration of a ``with`` block. The values are process-wide and not thread-safe: a knob for
    benchmarks and experiments, not something training code should need.

    Example::

        from shardkit.kernels import rms_norm
        with rms_norm.LAUNCH.override(fwd_warps=8, bwd_programs_per_sm=2):
            ...  # Triton rms_norm launches in here use these settings
    """

    def __init__(self, op: str, **allowed: tuple[int, ...]):
        self._op = op
        self._allowed = allowed
        self._values: dict[str, int | None] = dict.fromkeys(allowed)

    def get(self, name: str) -> int | None:
        """The current value of setting ``name`` (``None``: the op's heuristic)."""
        return self._values[name]

    def settings(self) -> dict[str, int | None]:
        """A copy of all current values."""
        return dict(self._values)

    @contextlib.contextmanager
    def override(self, **values: int | None) -> Iterator[None]:
        """Use ``values`` for the named settings inside the block; the previous values come back after it.

        Raises:
            TypeError: a name that is not a setting of this op.
            ValueError: a value outside the setting's allowed ones.
        """
        for name, value in values.items():
            if name not in self._allowed:
                raise TypeError(f"{self._op} has no launch setting {name!r}{did_you_mean(name, self._allowed)}; "
                                f"its settings are {', '.join(self._allowed)}")
            ok = self._allowed[name]
            if value is not None and (type(value) is not int or value not in ok):
                shown = value if type(value) is int else f"a {type(value).__name__}"
                raise ValueError(f"{self._op} launch setting {name}={shown} is not allowed: use one of "
                                 f"{', '.join(map(str, ok))}, or None for the op's heuristic")
        previous = dict(self._values)
        self._values.update(values)
        try:
            yield
        finally:
            self._values = previous


@triton.jit
def softcap_tanh(x, cap, HAS_SOFTCAP: tl.constexpr):
    """``cap * tanh(x / cap)`` when HAS_SOFTCAP (Gemma 2's logit softcap), else ``x``."""
    if HAS_SOFTCAP:
        # tanh(a) = sign(a) * (1 - e) / (1 + e), e = exp(-2|a|): no overflow for any a
        a = x / cap
        e = tl.exp(-2.0 * tl.abs(a))
        t = (1.0 - e) / (1.0 + e)
        x = cap * tl.where(a < 0, -t, t)
    return x
