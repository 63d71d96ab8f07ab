"""Triton rotary embedding (Hugging Face rotate-half layout) for q and k, forward and backward.

Reference: ``shardkit.ops.rope.rope_reference``. One program per (b, t) token: it loads that token's cos/sin
row once (through position_ids when given) and rotates every head of the token, BLOCK_H heads at a time, so
cos/sin are read B*T times instead of B*H*T times (32x fewer for Llama-7B's 32 heads).
  forward   y1 = x1*c1 - x2*s1,  y2 = x2*c2 + x1*s2
  backward  y1 = x1*c1 + x2*s2,  y2 = x2*c2 - x1*s1   (the transpose)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launch, dtype_label, empty_out, finish_out, meta

__all__ = ["compile_checks", "rope_apply"]


@triton.jit
def _rope_kernel(X, Y, COS, SIN, POS, sxb, sxh, sxt, H, T, cs_batch_rows, HALF,
                 HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    if HAS_POS:
        row = tl.load(POS + pid).to(tl.int64)
    else:
        row = b * cs_batch_rows + t
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cs = row * 2 * HALF
    c1 = tl.load(COS + cs + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(COS + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + cs + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + cs + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    if BACKWARD:
        s1, s2 = -s2, -s1
    # int64 offsets (b, t from the int64 pid, int64 heads): h * sxh and h * T * D pass 2^31 once one batch
    # element holds H*T*D > 2^31 elements. The token's base pointers are hoisted out of the head loop, which keeps
    # the 64-bit math per tile to one multiply per head row (sm_80 d=64 fp32: 32 registers, not 40).
    hs = tl.arange(0, BLOCK_H).to(tl.int64)
    x_tok = X + b * sxb + t * sxt
    y_tok = Y + (b * H * T + t) * (2 * HALF)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + hs
        mask = (h < H)[:, None] & dmask[None, :]
        src = x_tok + h[:, None] * sxh + d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = y_tok + h[:, None] * T * (2 * HALF) + d[None, :]
        tl.store(dst, (x1 * c1[None, :] - x2 * s1[None, :]).to(Y.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(Y.dtype.element_ty), mask=mask)


def _apply_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor | None,
               backward: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, H, T, D = x.shape
    y = empty_out(x, shape=(B, H, T, D))
    if y.numel() == 0:
        return finish_out(y, x.dtype)
    cs_batch_rows = T if (pos is None and cos.dim() == 3 and cos.shape[0] > 1) else 0
    # 8 heads x 64 half-dims = 512 elements per tile: 4 warps, 4 elements per thread
    block_h = min(8, triton.next_power_of_2(H))
    _rope_kernel[(B * T,)](x, y, cos, sin, pos if pos is not None else x, x.stride(0), x.stride(1), x.stride(2),
                           H, T, cs_batch_rows, D // 2, HAS_POS=pos is not None, BACKWARD=backward,
                           BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(D // 2))
    return finish_out(y, x.dtype)


def rope_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor | None, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hk, T, D); two launches since Hq != Hk under GQA.

    Shapes and position values are checked by ``shardkit.ops.rope``: the kernel reads cos/sin rows unchecked.
    """
    cos, sin = cos.contiguous(), sin.contiguous()
    pos = None
    if position_ids is not None:  # the kernel reads POS[b*T + t]: (T,) or (1, T) positions expand to (B, T) first
        pos = position_ids.expand(q.shape[0], q.shape[2]).to(torch.int64).contiguous()
    return _apply_one(q, cos, sin, pos, backward), _apply_one(k, cos, sin, pos, backward)


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """Both directions, with and without positions, at head dims 64 and 128 (scripts/check_triton.py)."""
    out: list[Launch] = []
    for dt in dtypes:
        for d in (64, 128):
            q, k = meta(2, 32, 256, d, dtype=dt), meta(2, 8, 256, d, dtype=dt)
            cos = meta(1, 256, d)  # fp32 tables with low-precision q/k: what HF rotary embeddings hand over
            pos = meta(2, 256, dtype=torch.int64)
            for backward in (False, True):
                for p in (None, pos):
                    label = f"rope d={d} {'bwd' if backward else 'fwd'}{' pos' if p is not None else ''} "
                    out.append((label + dtype_label(dt),
                                lambda q=q, k=k, c=cos, p=p, b=backward: rope_apply(q, k, c, c, p, b)))
    return out
