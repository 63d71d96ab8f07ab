"""Triton row pass of fused linear cross-entropy (the GPU path; also runs under TRITON_INTERPRET=1 on CPU).

Reference: :func:`shardkit.ops.fused_linear_cross_entropy.flce_rows_reference`. As in Liger-Kernel, the
matmuls stay cuBLAS (torch.mm in ``shardkit.ops.fused_linear_cross_entropy``); this kernel takes one chunk of
logits ``z`` (rows, V) and, one program per row, computes the loss and overwrites the row with
``row_scale * dloss/dz`` (label smoothing, logit softcap, ignore_index). Two sweeps over the row: an online
max/sum-exp (plus the sum of logits for smoothing), then the gradient write. The math is fp32 whatever ``z``'s
dtype: 16-bit logits (the matmul's own output for bf16/fp16 models) are read as they are and the gradient is
written over them rounded to their dtype, the rounding the matmuls that take it would apply anyway, so no fp32
copy of the chunk exists (Liger-Kernel's memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launch, dtype_label, meta, round_like, softcap_tanh

__all__ = ["compile_checks", "flce_rows_"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _flce_rows_kernel(z_ptr, z_stride, labels_ptr, scale_ptr, loss_ptr, V, ignore_index, eps, cap,
                      HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    label = tl.load(labels_ptr + row)
    # an out-of-range label (shardkit.ops raises on one before launching) gets a nan loss and no gradient
    # instead of reading a neighbouring row's logit, as the CUDA kernel does
    if (label == ignore_index) | (label < 0) | (label >= V):
        tl.store(loss_ptr + row, tl.where(label == ignore_index, 0.0, float("nan")))
        if WRITE_GRAD:
            for off in range(0, V, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                tl.store(z_row + cols, round_like(tl.zeros((BLOCK,), dtype=tl.float32), z_ptr), mask=cols < V)
        return

    # sweep 1: running max m, sum of exp(y - m) d, and sum of y for label smoothing
    m = float("-inf")
    d = 0.0
    sum_y = 0.0
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < V
        y = softcap_tanh(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), cap, HAS_SOFTCAP)
        y_m = tl.where(mask, y, float("-inf"))
        m_new = tl.maximum(m, tl.max(y_m, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(y_m - m_new), axis=0)
        m = m_new
        sum_y += tl.sum(tl.where(mask, y, 0.0), axis=0)
    lse = m + tl.log(d)
    y_t = softcap_tanh(tl.load(z_row + label).to(tl.float32), cap, HAS_SOFTCAP)
    tl.store(loss_ptr + row, lse - (1.0 - eps) * y_t - eps * (sum_y / V))

    if WRITE_GRAD:
        # sweep 2: g = scale * (softmax(y) - (1 - eps) * onehot - eps / V) * dy/dz, in place
        scale = tl.load(scale_ptr + row)
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < V
            y = softcap_tanh(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), cap, HAS_SOFTCAP)
            g = tl.exp(y - lse) - eps / V
            g = tl.where(cols == label, g - (1.0 - eps), g)
            if HAS_SOFTCAP:
                t = y / cap
                g = g * (1.0 - t * t)
            tl.store(z_row + cols, round_like(g * scale, z_ptr), mask=mask)


def flce_rows_(z: torch.Tensor, labels: torch.Tensor, row_scale: torch.Tensor, ignore_index: int,
               label_smoothing: float, softcap: float, write_grad: bool) -> torch.Tensor:
    """Row pass over logits ``z`` (rows, V; fp32, bf16 or fp16), in place when ``write_grad``; returns the fp32
    per-row loss.

    Labels outside [0, V) other than ``ignore_index`` are not checked here (the caller checks them first: no host
    sync per chunk); such a row gets a nan loss and a zero gradient.
    """
    if z.dtype not in _DTYPES or z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"flce_rows_: z must be 2-D float32, bfloat16 or float16 with contiguous rows, got "
                         f"{z.dtype} {tuple(z.shape)}")
    rows, vocab = z.shape
    loss = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows == 0:
        return loss
    # 4096 fp32 = 16 KiB per sweep step per program; under the interpreter smaller blocks only add Python steps
    block = min(triton.next_power_of_2(vocab), 4096)
    _flce_rows_kernel[(rows,)](
        z, z.stride(0), labels.contiguous(), row_scale.to(torch.float32).contiguous(), loss, vocab,
        ignore_index, float(label_smoothing), float(softcap) if softcap > 0 else 1.0,
        HAS_SOFTCAP=softcap > 0, WRITE_GRAD=write_grad, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return loss


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """The row pass on 512-row chunks at an odd vocab and Llama 3's 128256, with and without softcap and gradient
    on fp32 logits; and the gradient write at 128256 on the 16-bit logits of each 16-bit dtype in ``dtypes``."""
    out: list[Launch] = []
    cases = [(vocab, torch.float32, cap, grad) for vocab in (123, 128256) for cap in (0.0, 30.0) for grad in (0, 1)]
    cases += [(128256, dt, 0.0, True) for dt in dtypes if dt != torch.float32]
    for vocab, dt, cap, grad in cases:
        z, labels, scale = meta(512, vocab, dtype=dt), meta(512, dtype=torch.int64), meta(512)
        label = f"flce rows V={vocab} {dtype_label(dt)}{' softcap' if cap else ''}{' +grad' if grad else ''}"
        out.append((label, lambda z=z, lb=labels, sc=scale, c=cap, gr=bool(grad):
                    flce_rows_(z, lb, sc, -100, 0.1, c, gr)))
    return out
