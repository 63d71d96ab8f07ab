"""Triton LayerNorm forward and backward.

Reference: ``shardkit.ops.layer_norm.layer_norm_reference``. Same layout as ``rms_norm.py``: x is
(rows, n) contiguous, one program holds a whole row, fp32 statistics; mean and rstd (8 B per row) are saved for
backward. The backward splits rows across programs, each keeping its dw/db share in fp32 registers; torch sums
the (programs, n) partials (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launch, dtype_label, empty_out, finish_out, meta
from .rms_norm import row_programs, row_warps

__all__ = ["compile_checks", "layer_norm_bwd", "layer_norm_fwd"]


@triton.jit
def _layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, n, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, rows, n, rows_per_program,
                           BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (start + i).to(tl.int64)
        if row < rows:
            dy = tl.load(DY + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = tl.where(mask, (x - tl.load(MEAN + row)) * rstd, 0.0)
            g = dy * w
            c1 = tl.sum(g * xhat, axis=0) / n
            c2 = tl.sum(g, axis=0) / n
            tl.store(DX + row * n + cols, (rstd * (g - c2 - xhat * c1)).to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
    tl.store(DW_PARTIAL + pid * n + cols, dw, mask=mask)
    tl.store(DB_PARTIAL + pid * n + cols, db, mask=mask)


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """x (rows, n) contiguous -> (y like x, mean (rows,) fp32, rstd (rows,) fp32)."""
    rows, n = x.shape
    y = empty_out(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _layer_norm_fwd_kernel[(rows,)](x, weight, weight if bias is None else bias, y, mean, rstd, n, eps,
                                        HAS_BIAS=bias is not None, BLOCK=block, num_warps=row_warps(block))
    return finish_out(y, x.dtype), mean, rstd


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor):
    """(dy, x) (rows, n) contiguous, mean/rstd (rows,) -> (dx like x, dw like weight, db in weight's dtype)."""
    rows, n = x.shape
    dx = empty_out(x)
    programs = max(1, row_programs(x.device, rows))
    dw = torch.zeros(programs, n, dtype=torch.float32, device=x.device)
    db = torch.zeros(programs, n, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _layer_norm_bwd_kernel[(programs,)](dy, x, weight, mean, rstd, dx, dw, db, rows, n,
                                            triton.cdiv(rows, programs), BLOCK=block, num_warps=row_warps(block))
    return finish_out(dx, x.dtype), dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype)


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """Forward (with and without bias) and backward at GPT-2/Phi-class widths and an odd one."""
    out: list[Launch] = []
    for dt in dtypes:
        for n in (123, 2048, 4096, 8192):
            x, w, stat = meta(64, n, dtype=dt), meta(n, dtype=dt), meta(64)
            s = dtype_label(dt)
            out.append((f"layer_norm fwd n={n} {s}", lambda x=x, w=w: layer_norm_fwd(x, w, w, 1e-5)))
            out.append((f"layer_norm fwd no bias n={n} {s}", lambda x=x, w=w: layer_norm_fwd(x, w, None, 1e-5)))
            out.append((f"layer_norm bwd n={n} {s}", lambda x=x, w=w, r=stat: layer_norm_bwd(x, x, w, r, r)))
    return out
