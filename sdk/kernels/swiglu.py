"""Triton SwiGLU and GeGLU forward and backward (elementwise over flat contiguous tensors).

References: ``shardkit.ops.swiglu.swiglu_reference`` and ``shardkit.ops.geglu.geglu_reference``. Both are
``y = g * sigmoid(a(g)) * u`` with ``a(g) = g`` (silu) or ``2 sqrt(2/pi) (g + 0.044715 g^3)`` (gelu with the tanh
approximation, since ``0.5 (1 + tanh z) = sigmoid(2 z)``), so one kernel with a constexpr ``GELU`` serves both.
Backward recomputes the sigmoid instead of reading a saved product: one extra exp per element is free in a
kernel bound by moving 3 reads + 2 writes x 2 B. The in-place backward passes ``DG = G`` and ``DU = U``: each
program loads its elements before it stores them and no other program touches them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launch, dtype_label, empty_out, finish_out, meta

__all__ = ["compile_checks", "geglu_compile_checks", "glu_bwd", "glu_bwd_inplace", "glu_fwd", "swiglu_bwd",
           "swiglu_fwd"]

# 1024 elements per program = 4 warps x 32 threads x 8 elements: 16-byte bf16 vectors per thread.
_BLOCK = 1024


@triton.jit
def _act_arg(g, GELU: tl.constexpr):
    if GELU:
        return 1.5957691216057308 * (g + 0.044715 * g * g * g)
    else:
        return g


@triton.jit
def _act_darg(g, GELU: tl.constexpr):
    if GELU:
        return 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        return tl.full(g.shape, 1.0, tl.float32)


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, numel, BLOCK: tl.constexpr, GELU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(_act_arg(g, GELU)) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, numel, BLOCK: tl.constexpr, GELU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(_act_arg(g, GELU))
    dg = dy * u * (sig + g * sig * (1.0 - sig) * _act_darg(g, GELU))
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * g * sig).to(DU.dtype.element_ty), mask=mask)


def glu_fwd(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """gate, up contiguous, same shape/dtype -> act(gate) * up (act: silu, or gelu-tanh when ``gelu``)."""
    y = empty_out(gate)
    n = gate.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, y, n, BLOCK=_BLOCK, GELU=gelu)
    return finish_out(y, gate.dtype)


def glu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, gate, up) contiguous -> (d gate, d up) in fresh tensors."""
    dg, du = empty_out(gate), empty_out(up)
    n = gate.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dy.to(gate.dtype), gate, up, dg, du, n, BLOCK=_BLOCK,
                                                      GELU=gelu)
    return finish_out(dg, gate.dtype), finish_out(du, up.dtype)


def glu_bwd_inplace(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> None:
    """(dy, gate, up) contiguous: writes d gate over ``gate`` and d up over ``up``."""
    n = gate.numel()
    if not n:
        return
    if gate.device.type == "cpu" and gate.dtype != torch.float32:  # interpreter: fp32 stores, torch rounds (empty_out)
        dg, du = glu_bwd(dy, gate, up, gelu)
        gate.copy_(dg)
        up.copy_(du)
        return
    _swiglu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dy.to(gate.dtype), gate, up, gate, up, n, BLOCK=_BLOCK,
                                                  GELU=gelu)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up contiguous, same shape/dtype -> silu(gate) * up."""
    return glu_fwd(gate, up, False)


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, gate, up) contiguous -> (d gate, d up)."""
    return glu_bwd(dy, gate, up, False)


def _checks(dtypes: tuple[torch.dtype, ...], gelu: bool) -> list[Launch]:
    name = "geglu" if gelu else "swiglu"
    out: list[Launch] = []
    for dt in dtypes:
        g = meta(4096, 11008, dtype=dt)
        out.append((f"{name} fwd {dtype_label(dt)}", lambda g=g: glu_fwd(g, g, gelu)))
        out.append((f"{name} bwd {dtype_label(dt)}", lambda g=g: glu_bwd(g, g, g, gelu)))
        out.append((f"{name} bwd in place {dtype_label(dt)}", lambda g=g: glu_bwd_inplace(g, g, g, gelu)))
    return out


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """SwiGLU forward and backward at a 7B Llama MLP's (tokens, intermediate) = (4096, 11008)."""
    return _checks(dtypes, False)


def geglu_compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """GeGLU forward and backward at the same shape (Gemma 7B's MLP is 24576 wide; the kernel is elementwise)."""
    return _checks(dtypes, True)
