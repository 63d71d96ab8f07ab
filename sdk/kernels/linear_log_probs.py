"""Triton row passes of the chunked log-probs (the GPU path; also runs under TRITON_INTERPRET=1 on CPU).

Reference: :func:`shardkit.ops.linear_log_probs.rows_forward_reference` and ``rows_backward_reference``. As for
the fused cross-entropy, the matmuls stay cuBLAS (``shardkit.ops.linear_log_probs``'s chunk loop); these kernels
take one chunk of logits ``z`` (rows, V), one program per row. Forward: one online sweep for the logsumexp of
``s = softcap(z) / T``, the label's ``s`` and (for the entropy) ``m = sum(softmax(s) * s)`` (kept relative to the
running max, rescaled as it moves). Backward: one sweep writing the gradient over ``z`` (rounded to ``z``'s dtype,
no fp32 copy of the chunk). Labels outside [0, V) mean "not among these columns" (a vocab-parallel slice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launch, dtype_label, meta, round_like, softcap_tanh

__all__ = ["compile_checks", "llp_rows_backward_", "llp_rows_forward"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _llp_rows_fwd_kernel(z_ptr, z_stride, labels_ptr, lse_ptr, target_ptr, m_ptr, V, cap, inv_temp,
                         HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    label = tl.load(labels_ptr + row)
    mx = float("-inf")
    d = 0.0
    w = 0.0  # sum of exp(s - mx) * s
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < V
        s = softcap_tanh(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), cap, HAS_SOFTCAP) * inv_temp
        s_m = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(mx, tl.max(s_m, axis=0))
        alpha = tl.exp(mx - m_new)
        e = tl.exp(s_m - m_new)
        d = d * alpha + tl.sum(e, axis=0)
        if ENTROPY:
            w = w * alpha + tl.sum(tl.where(mask, e * s, 0.0), axis=0)
        mx = m_new
    tl.store(lse_ptr + row, mx + tl.log(d))
    here = (label >= 0) & (label < V)
    safe = tl.where(here, label, 0)
    s_t = softcap_tanh(tl.load(z_row + safe).to(tl.float32), cap, HAS_SOFTCAP) * inv_temp
    tl.store(target_ptr + row, tl.where(here, s_t, 0.0))
    if ENTROPY:
        tl.store(m_ptr + row, w / d)


@triton.jit
def _llp_rows_bwd_kernel(z_ptr, z_stride, labels_ptr, glp_ptr, gent_ptr, lse_ptr, m_ptr, V, cap, inv_temp,
                         HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * z_stride
    label = tl.load(labels_ptr + row)
    glp = tl.load(glp_ptr + row)
    lse = tl.load(lse_ptr + row)
    if ENTROPY:
        gent = tl.load(gent_ptr + row)
        m = tl.load(m_ptr + row)
    for off in range(0, V, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < V
        y = softcap_tanh(tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32), cap, HAS_SOFTCAP)
        s = y * inv_temp
        p = tl.exp(s - lse)
        g = -glp * p
        if ENTROPY:
            g = g - gent * p * (s - m)
        g = tl.where(cols == label, g + glp, g)
        g = g * inv_temp
        if HAS_SOFTCAP:
            t = y / cap
            g = g * (1.0 - t * t)
        tl.store(z_row + cols, round_like(g, z_ptr), mask=mask)


def _check(z: torch.Tensor, name: str) -> tuple[int, int, int]:
    if z.dtype not in _DTYPES or z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"{name}: z must be 2-D float32, bfloat16 or float16 with contiguous rows, got "
                         f"{z.dtype} {tuple(z.shape)}")
    rows, vocab = z.shape
    # 4096 fp32 = 16 KiB per sweep step per program, as the fused cross-entropy's row pass
    block = min(triton.next_power_of_2(max(vocab, 1)), 4096)
    return rows, vocab, block


def llp_rows_forward(z: torch.Tensor, labels: torch.Tensor, softcap: float, inv_temp: float,
                     want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(lse, target, m)`` (fp32; ``m`` empty without ``want_entropy``) of logits ``z`` (rows, V)."""
    rows, vocab, block = _check(z, "llp_rows_forward")
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    target = torch.empty_like(lse)
    m = torch.empty(rows if want_entropy else 0, dtype=torch.float32, device=z.device)
    if rows:
        _llp_rows_fwd_kernel[(rows,)](
            z, z.stride(0), labels.contiguous(), lse, target, m if want_entropy else lse, vocab,
            float(softcap) if softcap > 0 else 1.0, float(inv_temp), HAS_SOFTCAP=softcap > 0,
            ENTROPY=bool(want_entropy), BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return lse, target, m


def llp_rows_backward_(z: torch.Tensor, labels: torch.Tensor, grad_lp: torch.Tensor, grad_ent: torch.Tensor,
                       lse: torch.Tensor, m: torch.Tensor, softcap: float, inv_temp: float) -> None:
    """Overwrites ``z`` (rows, V) with the gradient of ``sum(grad_lp * logp + grad_ent * entropy)`` (no entropy
    term when ``grad_ent`` is empty); ``lse``/``m`` are the rows' statistics over the whole vocabulary."""
    rows, vocab, block = _check(z, "llp_rows_backward_")
    entropy = grad_ent.numel() > 0
    f32 = [t.to(torch.float32).contiguous() for t in (grad_lp, grad_ent if entropy else grad_lp, lse,
                                                     m if entropy else lse)]
    if rows:
        _llp_rows_bwd_kernel[(rows,)](
            z, z.stride(0), labels.contiguous(), *f32, vocab, float(softcap) if softcap > 0 else 1.0,
            float(inv_temp), HAS_SOFTCAP=softcap > 0, ENTROPY=entropy, BLOCK=block,
            num_warps=8 if block >= 2048 else 4)


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """Both row passes on 512-row chunks at an odd vocab and Llama 3's 128256, with and without softcap and
    entropy on fp32 logits; the backward write at 128256 on the 16-bit logits of each 16-bit dtype in ``dtypes``."""
    out: list[Launch] = []
    cases = [(vocab, torch.float32, cap, ent) for vocab in (123, 128256) for cap in (0.0, 30.0) for ent in (0, 1)]
    cases += [(128256, dt, 0.0, True) for dt in dtypes if dt != torch.float32]
    for vocab, dt, cap, ent in cases:
        z, labels, row = meta(512, vocab, dtype=dt), meta(512, dtype=torch.int64), meta(512)
        tag = f"V={vocab} {dtype_label(dt)}{' softcap' if cap else ''}{' entropy' if ent else ''}"
        out.append((f"llp fwd {tag}", lambda z=z, lb=labels, c=cap, e=bool(ent): llp_rows_forward(z, lb, c, 0.7, e)))
        out.append((f"llp bwd {tag}", lambda z=z, lb=labels, r=row, c=cap, e=bool(ent):
                    llp_rows_backward_(z, lb, r, r if e else r[:0], r, r, c, 0.7)))
    return out
