"""Triton AdamW step over a whole list of tensors in one launch (the GPU path of FusedAdamW; also runs under
TRITON_INTERPRET=1 on CPU).

Reference: ``shardkit.ops.adamw.adamw_step_reference`` (torch._foreach ops) and torch.optim.AdamW. One fused pass
reads p (or its fp32 master), g, m, v and writes them back (28 bytes/param in fp32), with the same operation order
as torch so fp32 results agree to rounding.

Multi-tensor launch: the tensors of one call are cut into tiles of ``BLOCK`` elements, and one program updates one
tile. The launcher hands the kernel three small device tables: each tensor's five addresses (param, master, grad,
exp_avg, exp_avg_sq) and size, and each tile's (tensor, first element). One launch per (param dtype, grad dtype)
pair then covers a whole param group: on the H200, one launch per tensor made 97M parameters in 48 tensors
take 1.14 ms against 0.68 ms for 100M in one tensor (benchmarks/RESULTS.md). Full tiles load and store without a
mask and, when every address is 16-byte aligned (the launcher checks), with that alignment promised to the
compiler: 128-bit loads and stores, which a size or address read from a table would otherwise forbid. The tile
table depends only on the sizes and is cached; the address table is rebuilt (one small host-to-device copy) only
when an address changes.

Launch settings: :data:`LAUNCH` (``block``: elements per tile; ``num_warps``) overrides the defaults (2048 and 8
warps on CUDA, 1024 and 4 interpreted) for a sweep, e.g. ``with LAUNCH.override(block=8192): ...``
(benchmarks/gpu_tune.py); both ``None`` by default.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import Launch, LaunchConfig, dtype_label, meta, round_like

__all__ = ["LAUNCH", "adamw_step_", "compile_checks", "launch_settings"]

LAUNCH = LaunchConfig("adamw", block=tuple(1 << k for k in range(8, 17)), num_warps=(1, 2, 4, 8, 16, 32))
"""Overrides of the launch defaults (``None``: :func:`launch_settings`' defaults)."""

_SLOTS = 5  # addresses per tensor in the table: param, master (the param again without one), grad, exp_avg, sq
_ALIGN = 16  # bytes: one 128-bit load or store


@triton.jit
def _address(table, t, slot: tl.constexpr, like, ALIGNED: tl.constexpr):
    """The pointer in ``slot`` of tensor ``t``'s row of the address table, typed like ``like``."""
    ptr = tl.load(table + t * 5 + slot).to(like.dtype)
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _ld(ptr, offs, n, FULL: tl.constexpr):
    if FULL:
        return tl.load(ptr + offs).to(tl.float32)
    return tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)


@triton.jit
def _st(ptr, offs, n, value, FULL: tl.constexpr):
    if FULL:
        tl.store(ptr + offs, value)
    else:
        tl.store(ptr + offs, value, mask=offs < n)


@triton.jit
def _adamw_tile(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, offs, n, decay, beta1, beta2, eps, step_size, bc2_sqrt,
                HAS_MASTER: tl.constexpr, MAXIMIZE: tl.constexpr, FULL: tl.constexpr):
    if HAS_MASTER:
        p = _ld(master_ptr, offs, n, FULL)
    else:
        p = _ld(p_ptr, offs, n, FULL)
    g = _ld(g_ptr, offs, n, FULL)
    if MAXIMIZE:
        g = -g
    m = _ld(m_ptr, offs, n, FULL)
    v = _ld(v_ptr, offs, n, FULL)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    # sqrt_rn: IEEE square root like torch (tl.sqrt may lower to the approximate instruction)
    p = p - step_size * (m / (tl.sqrt_rn(v) / bc2_sqrt + eps))
    _st(m_ptr, offs, n, m, FULL)
    _st(v_ptr, offs, n, v, FULL)
    if HAS_MASTER:
        _st(master_ptr, offs, n, p, FULL)
    _st(p_ptr, offs, n, round_like(p, p_ptr), FULL)


@triton.jit
def _adamw_multi_kernel(addresses, sizes, tiles, hyper, p_like, g_like, f32_like, decay, beta1, beta2, eps, step_size,
                        bc2_sqrt, HAS_MASTER: tl.constexpr, MAXIMIZE: tl.constexpr, PER_TENSOR: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(tiles + 2 * pid)
    start = tl.multiple_of(tl.load(tiles + 2 * pid + 1), BLOCK)  # tiles start at multiples of BLOCK
    n = tl.load(sizes + t)
    p_ptr = _address(addresses, t, 0, p_like, ALIGNED)
    master_ptr = _address(addresses, t, 1, f32_like, ALIGNED)
    g_ptr = _address(addresses, t, 2, g_like, ALIGNED)
    m_ptr = _address(addresses, t, 3, f32_like, ALIGNED)
    v_ptr = _address(addresses, t, 4, f32_like, ALIGNED)
    if PER_TENSOR:  # tensors at different step counts: (step size, sqrt(1 - beta2^t)) per tensor in ``hyper``
        step_size = tl.load(hyper + 2 * t)
        bc2_sqrt = tl.load(hyper + 2 * t + 1)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _adamw_tile(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, offs, n, decay, beta1, beta2, eps, step_size, bc2_sqrt,
                    HAS_MASTER, MAXIMIZE, True)
    else:
        _adamw_tile(p_ptr, master_ptr, g_ptr, m_ptr, v_ptr, offs, n, decay, beta1, beta2, eps, step_size, bc2_sqrt,
                    HAS_MASTER, MAXIMIZE, False)


def launch_settings(cuda: bool) -> tuple[int, int]:
    """(BLOCK, num_warps) of the next launch: :data:`LAUNCH`'s overrides, else the defaults."""
    if not cuda:
        return LAUNCH.get("block") or 1024, LAUNCH.get("num_warps") or 4
    # 8 elements a thread: two (fp32) or one (16-bit) 128-bit access per tensor. Compiled for sm_90 here
    # (scripts/check_triton.py): B2048 w8 takes 53 registers/thread in fp32 and 80 with a bf16 param and master;
    # B4096 w4 (the per-tensor kernel's old default) 182 and 254, at a quarter of the occupancy or less.
    return LAUNCH.get("block") or 2048, LAUNCH.get("num_warps") or 8


@functools.lru_cache(maxsize=16)
def _tile_table(sizes: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    """(tensor index, first element) of every tile, flattened int64 on ``device``; cached: sizes rarely change."""
    counts = torch.tensor([-(-n // block) for n in sizes], dtype=torch.int64)
    index = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int64), counts)
    first_tile = torch.cumsum(counts, 0) - counts
    start = (torch.arange(len(index), dtype=torch.int64) - first_tile[index]) * block
    return torch.stack([index, start], dim=1).reshape(-1).to(device)


@functools.lru_cache(maxsize=16)
def _size_table(sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The tensors' sizes, int64 on ``device``; cached like the tile table."""
    return torch.tensor(sizes, dtype=torch.int64).to(device)


class _AddressCache:
    """The last few address tables built, by their addresses: an optimizer's tensors keep theirs between steps
    (a gradient reallocated by ``zero_grad(set_to_none=True)`` usually gets the same block back)."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._tables: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, device: torch.device) -> torch.Tensor:
        table = self._tables.pop(key, None)
        if table is None:
            table = torch.tensor(key[2:], dtype=torch.int64).to(device, non_blocking=True)
            if len(self._tables) >= self._size:
                self._tables.pop(next(iter(self._tables)))
        self._tables[key] = table  # most recent last
        return table


_ADDRESSES = _AddressCache()


def _group_by_dtype(params: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[tuple, list[int]]:
    """Indices of the non-empty tensors per (param dtype, grad dtype): the pointer types of one launch."""
    groups: dict[tuple, list[int]] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.numel():
            groups.setdefault((p.dtype, g.dtype), []).append(i)
    return groups


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], masters: list[torch.Tensor], step_sizes: list[float],
                bc2_sqrts: list[float], lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                maximize: bool) -> None:
    """Same contract as ``torch.ops.shardkit_C.adamw_step_``: all updated in place, one launch per dtype pair.

    ``masters`` is empty or one fp32 tensor per param; every tensor is contiguous and on one device.
    """
    if not params:
        return
    device = params[0].device
    block, warps = launch_settings(device.type != "cpu")  # meta: check_triton.py compiles the CUDA default
    for idx in _group_by_dtype(params, grads).values():
        rows = [(params[i], masters[i] if masters else params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]) for i in idx]
        uniform = len({step_sizes[i] for i in idx}) == 1 and len({bc2_sqrts[i] for i in idx}) == 1
        if device.type == "meta":  # scripts/check_triton.py compiles on meta tensors: no addresses to read
            addresses = meta(len(idx) * _SLOTS, dtype=torch.int64)
            aligned = True
        else:
            ptrs = [t.data_ptr() for row in rows for t in row]
            addresses = _ADDRESSES.get((device, len(idx), *ptrs), device)
            aligned = all(a % _ALIGN == 0 for a in ptrs)
        sizes = tuple(params[i].numel() for i in idx)
        tiles = _tile_table(sizes, block, device)
        n_tiles = tiles.numel() // 2
        hyper = rows[0][3] if uniform else torch.tensor(  # uniform: the scalars below, the table is not read
            [v for i in idx for v in (step_sizes[i], bc2_sqrts[i])], dtype=torch.float32).to(device, non_blocking=True)
        _adamw_multi_kernel[(n_tiles,)](
            addresses, _size_table(sizes, device), tiles, hyper, rows[0][0], rows[0][2], rows[0][3],
            1.0 - lr * weight_decay, beta1, beta2, eps,
            step_sizes[idx[0]], bc2_sqrts[idx[0]], HAS_MASTER=bool(masters), MAXIMIZE=maximize,
            PER_TENSOR=not uniform, ALIGNED=aligned, BLOCK=block, num_warps=warps)


def compile_checks(dtypes: tuple[torch.dtype, ...]) -> list[Launch]:
    """One launch over two 4 Mi-element tensors per param dtype, fp32 masters for 16-bit params (check_triton.py)."""
    out: list[Launch] = []
    for dt in dtypes:
        master = [meta(4 << 20)] * 2 if dt != torch.float32 else []
        p, st = [meta(4 << 20, dtype=dt)] * 2, [meta(4 << 20)] * 2
        out.append((f"adamw {dtype_label(dt)}{' +master' if master else ''}",
                    lambda p=p, st=st, m=master: adamw_step_(p, p, st, st, m, [1e-3] * 2, [1.0] * 2, 1e-3, 0.9,
                                                             0.999, 1e-8, 0.01, False)))
    return out
