"""Triton AdamW step (the GPU path of FusedAdamW; also runs under TRITON_INTERPRET=1 on CPU).

Reference: ``shardkit.optim.adamw._step_reference`` (torch._foreach ops) and torch.optim.AdamW. One fused pass
per tensor reads p (or its fp32 master), g, m, v and writes them back (28 bytes/param in fp32), with the same
operation order as torch so fp32 results agree to rounding.

Launch settings: :data:`LAUNCH` (``block``: elements per program; ``num_warps``) overrides the defaults (4096 on
CUDA, 1024 interpreted; 4 warps) for a sweep, e.g. ``with LAUNCH.override(block=8192): ...``
(benchmarks/gpu_tune.py); both ``None`` by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launch, LaunchConfig, dtype_label, meta

__all__ = ["LAUNCH", "adamw_step_", "compile_checks", "launch_settings"]

LAUNCH = LaunchConfig("adamw", block=tuple(1 << k for k in range(8, 17)), num_warps=(1, 2, 4, 8, 16, 32))
"""Overrides of the launch defaults (``None``: BLOCK 4096 on CUDA, 1024 interpreted; 4 warps)."""


@triton.jit
def _adamw_kernel(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, n, decay, beta1, beta2, eps, step_size, bc2_sqrt,
                  HAS_MASTER: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_MASTER:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    # sqrt_rn: IEEE square root like torch (tl.sqrt may lower to the approximate instruction)
    p = p - step_size * (m / (tl.sqrt_rn(v) / bc2_sqrt + eps))
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offs, p, mask=mask)
    if p_ptr.dtype.element_ty == tl.bfloat16:
        # round to nearest even by hand: the interpreter's fp32 -> bf16 cast truncates (nan never occurs here
        # unless the inputs hold one)
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(p_ptr + offs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


def launch_settings(cuda: bool) -> tuple[int, int]:
    """(BLOCK, num_warps) of the next launch: :data:`LAUNCH`'s overrides, else the defaults."""
    # 4096 elements x 28 B = 112 KiB of traffic per program: enough to hide latency at 4 warps
    block = LAUNCH.get("block") or (4096 if cuda else 1024)
    return block, LAUNCH.get("num_warps") or 4  # 4: triton's own default


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], masters: list[torch.Tensor], step_sizes: list[float],
                bc2_sqrts: list[float], lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                maximize: bool) -> None:
    """Same contract as ``torch.ops.shardkit_C.adamw_step_``: one launch per tensor, all updated in place."""
    decay = 1.0 - lr * weight_decay
    block, warps = launch_settings(bool(params) and params[0].is_cuda)
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        master = masters[i] if masters else p
        _adamw_kernel[(triton.cdiv(n, block),)](
            p, master, grads[i], exp_avgs[i], exp_avg_sqs[i], n, decay, beta1, beta2, eps, step_sizes[i],
            bc2_sqrts[i], HAS_MASTER=bool(masters), MAXIMIZE=maximize, BLOCK=block, num_warps=warps)


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """One 4 Mi-element tensor per param dtype, with fp32 masters for 16-bit params (scripts/check_triton.py)."""
    out: list[Launch] = []
    for dt in dtypes:
        master = [meta(4 << 20)] if dt != torch.float32 else []
        p, st = [meta(4 << 20, dtype=dt)], [meta(4 << 20)]
        out.append((f"adamw {dtype_label(dt)}{' +master' if master else ''}",
                    lambda p=p, st=st, m=master: adamw_step_(p, p, st, st, m, [1e-3], [1.0], 1e-3, 0.9, 0.999, 1e-8,
                                                             0.01, False)))
    return out
