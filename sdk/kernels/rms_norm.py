"""Triton RMSNorm forward and backward.

Reference: ``shardkit.ops.rms_norm.rms_norm_reference`` (the oracle the tests hold these kernels to).
Layout: x is (rows, n) contiguous; one program per row holds the whole row in registers, so BLOCK = next
power of two >= n (n = 4096 -> 4096 fp32 = 16 KiB per program, fine for a 228 KiB-SMEM H100 SM). fp32
accumulation whatever the storage dtype; only rstd (4 B per row) is saved for backward.

Launch settings: :data:`LAUNCH` (``fwd_warps``, ``bwd_warps``: warps per program; ``bwd_programs_per_sm``:
backward programs per SM) overrides the heuristics below for a sweep, e.g.
``with LAUNCH.override(bwd_warps=8): ...`` (benchmarks/gpu_tune.py); all ``None`` by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launch, LaunchConfig, dtype_label, empty_out, finish_out, meta

__all__ = ["LAUNCH", "compile_checks", "launch_settings", "rms_norm_bwd", "rms_norm_fwd"]

_WARPS = (1, 2, 4, 8, 16, 32)
LAUNCH = LaunchConfig("rms_norm", fwd_warps=_WARPS, bwd_warps=_WARPS, bwd_programs_per_sm=tuple(range(1, 17)))
"""Overrides of the launch heuristics (``None``: :func:`row_warps`, one backward program per SM)."""


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, n, eps, offset, BLOCK: tl.constexpr):
    # int64 row offset: rows * n passes 2^31 at e.g. 8 x 4096 x 65536 elements
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * n + cols, (x * rstd * (w + offset)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, rows, n, rows_per_program, offset,
                         BLOCK: tl.constexpr):
    # Each program walks rows_per_program rows and keeps its dw share in fp32 registers; the (programs, n)
    # partials are summed by torch afterwards: no atomics, deterministic (Liger uses the same split).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (start + i).to(tl.int64)
        if row < rows:
            dy = tl.load(DY + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = x * rstd
            g = dy * w
            mean = tl.sum(g * xhat, axis=0) / n
            tl.store(DX + row * n + cols, (rstd * (g - xhat * mean)).to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
    tl.store(DW_PARTIAL + pid * n + cols, dw, mask=mask)


def launch_settings(n: int, rows: int, device: torch.device) -> dict[str, int]:
    """The launch settings the next call at row width ``n`` and ``rows`` rows uses (:data:`LAUNCH` applied)."""
    block = triton.next_power_of_2(n)
    return {"fwd_warps": _num_warps(block, "fwd_warps"), "bwd_warps": _num_warps(block, "bwd_warps"),
            "bwd_programs": _num_programs(device, rows)}


def row_warps(block: int) -> int:
    """Warps for one program holding a whole row of ``block`` elements (also the LayerNorm kernels' choice)."""
    # 8 elements of each row tensor per thread. With the default 4 warps a 4096-wide row is 32 elements per
    # thread: the backward kernel then takes 190-206 registers (12% occupancy on sm_80/sm_90), and at 8192 it
    # spills 312-352 B/thread to local memory (scripts/check_triton.py; compiled, not run: no GPU here).
    return max(4, min(32, block // 256))


def _num_warps(block: int, setting: str) -> int:
    chosen = LAUNCH.get(setting)
    return row_warps(block) if chosen is None else chosen


def row_programs(device: torch.device, rows: int, per_sm: int = 1) -> int:
    """Backward programs for ``rows`` rows, each summing its share of the weight gradient (also LayerNorm's)."""
    if device.type == "cuda":
        # one program per SM: an H100 has 132, enough rows per program to amortise the dw partial write
        return min(rows, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(rows, per_sm * 4)  # interpreter: fewer programs, fewer Python-level launches


def _num_programs(device: torch.device, rows: int) -> int:
    return row_programs(device, rows, LAUNCH.get("bwd_programs_per_sm") or 1)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """x (rows, n) contiguous -> (y like x, rstd (rows,) fp32)."""
    rows, n = x.shape
    y = empty_out(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_fwd_kernel[(rows,)](x, weight, y, rstd, n, eps, offset, BLOCK=block,
                                      num_warps=_num_warps(block, "fwd_warps"))
    return finish_out(y, x.dtype), rstd


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float):
    """(dy, x) (rows, n) contiguous, rstd (rows,) -> (dx like x, dw like weight)."""
    rows, n = x.shape
    dx = empty_out(x)
    programs = max(1, _num_programs(x.device, rows))
    partial = torch.zeros(programs, n, dtype=torch.float32, device=x.device)
    if rows:
        per = triton.cdiv(rows, programs)
        block = triton.next_power_of_2(n)
        _rms_norm_bwd_kernel[(programs,)](dy, x, weight, rstd, dx, partial, rows, n, per, offset,
                                          BLOCK=block, num_warps=_num_warps(block, "bwd_warps"))
    return finish_out(dx, x.dtype), partial.sum(0).to(weight.dtype)


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """Forward and backward at Llama-class widths and an odd one (scripts/check_triton.py)."""
    out: list[Launch] = []
    for dt in dtypes:
        for n in (123, 2048, 4096, 8192):
            x, w, rstd = meta(64, n, dtype=dt), meta(n, dtype=dt), meta(64)
            s = dtype_label(dt)
            out.append((f"rms_norm fwd n={n} {s}", lambda x=x, w=w: rms_norm_fwd(x, w, 1e-6, 0.0)))
            out.append((f"rms_norm bwd n={n} {s}", lambda x=x, w=w, r=rstd: rms_norm_bwd(x, x, w, r, 0.0)))
    return out
