"""Rotary position embedding (Hugging Face rotate-half layout) for q and k in one call.

``q, k``: (B, H, T, D) (H may differ between q and k, as in GQA; any strides with a contiguous last dim).
``cos, sin``: (1 or B, T, D), or (max_position, D) indexed by ``position_ids`` of any shape that broadcasts to
(B, T): (T,), (1, T) (what Hugging Face builds for a batch) or (B, T). Every backend expands them to (B, T).
Forward ``y = x * cos + rotate_half(x) * sin``; backward applies the transpose of that rotation, i.e. the
rotation by ``-sin`` for HF's duplicated-halves cos/sin. cos/sin get no gradient (they come from buffers).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .registry import OpSpec, direct_call_ok, native, register

__all__ = ["SPEC", "rope", "rope_reference"]


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _broadcast_positions(position_ids: Tensor, B: int, T: int) -> Tensor:
    """``position_ids`` as a (B, T) view; (T,), (1, T), (B, 1) etc. broadcast like the reference's indexing."""
    shape = tuple(position_ids.shape)
    if len(shape) > 2 or any(n != 1 and n != m for n, m in zip(reversed(shape), (T, B))):
        raise ValueError(f"rope: position_ids of shape {shape} do not broadcast to (B, T) = ({B}, {T}); "
                         "pass (T,), (1, T) or (B, T)")
    return position_ids.expand(B, T)


def _gather(cs: Tensor, position_ids: Tensor | None, B: int, T: int) -> Tensor:
    """cos/sin as (B or 1, 1, T, D), broadcastable over heads."""
    if position_ids is not None:
        cs = cs[_broadcast_positions(position_ids, B, T).long()]
    return cs.unsqueeze(1)


def _check_shapes(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None) -> None:
    """Shape-only checks (free, also run on fake tensors under torch.compile): the native kernels trust them."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope: q and k must be (B, H, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D or D % 2:
        raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share B, T and an even head_dim")
    if sin.shape != cos.shape or cos.shape[-1] != D:
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must match, last dim {D}")
    if position_ids is not None:
        if cos.dim() != 2:
            raise ValueError(f"rope: with position_ids cos/sin must be the (max_position, D) table, got "
                             f"{tuple(cos.shape)}")
        _broadcast_positions(position_ids, B, T)
    elif cos.dim() != 3 or cos.shape[1] != T or cos.shape[0] not in (1, B):
        raise ValueError(f"rope: without position_ids cos/sin must be (1 or B, T, D) = (1 or {B}, {T}, {D}), got "
                         f"{tuple(cos.shape)}")


def _check_positions(position_ids: Tensor, rows: int) -> None:
    """Every position indexes a row of the (rows, D) cos/sin table (the native kernels do not bounds-check).

    NOTE: the bound needs the min/max of position_ids. On CPU reading them is free, so a bad position raises an
    IndexError naming the fix. On CUDA reading them would sync the host with the GPU on every call (a stall per
    layer), so the check is queued with ``torch._assert_async`` instead: no sync, a few tiny kernels over B*T
    ints, and a bad position fails as a device-side assert, as ``cos[position_ids]`` of the reference does on
    CUDA (it poisons the CUDA context, but reading out of bounds could only be worse: garbage or a fault).
    Under torch.compile this runs inside the opaque custom op, at run time, so it never breaks tracing.
    """
    if position_ids.numel() == 0:
        return
    lo, hi = torch.aminmax(position_ids)
    if position_ids.device.type != "cpu":
        torch._assert_async((lo >= 0) & (hi < rows), "rope: position_ids out of the cos/sin table's range")
        return
    lo, hi = int(lo), int(hi)
    if hi >= rows:
        raise IndexError(f"rope: position_ids max {hi} >= cos/sin table length {rows}: build the rotary table for "
                         f"at least {hi + 1} positions (e.g. RotaryEmbedding(max_position={hi + 1}))")
    if lo < 0:
        raise IndexError(f"rope: position_ids min {lo} < 0: positions index rows 0..{rows - 1} of the cos/sin table")


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                   position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch RoPE (differentiable by autograd), computed in fp32 for low-precision inputs."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T = q.shape[0], q.shape[2]
    c, s = _gather(cos, position_ids, B, T).to(acc), _gather(sin, position_ids, B, T).to(acc)
    out = []
    for x in (q, k):
        xf = x.to(acc)
        out.append((xf * c + _rotate_half(xf) * s).to(x.dtype))
    return out[0], out[1]


def _reference_apply(x: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None, backward: bool) -> Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    B, T = x.shape[0], x.shape[2]
    c, s = _gather(cos, position_ids, B, T).to(acc), _gather(sin, position_ids, B, T).to(acc)
    xf = x.to(acc)
    if not backward:
        return (xf * c + _rotate_half(xf) * s).to(x.dtype).contiguous()
    # transpose of x -> x*c + R(x)*s with R(v) = [-v2, v1]: x*c + R^T(x*s), R^T(v) = [v2, -v1]
    v1, v2 = (xf * s).chunk(2, dim=-1)
    return (xf * c + torch.cat((v2, -v1), dim=-1)).to(x.dtype).contiguous()


def _reference_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None,
                    backward: bool) -> tuple[Tensor, Tensor]:
    return (_reference_apply(q, cos, sin, position_ids, backward),
            _reference_apply(k, cos, sin, position_ids, backward))


def _apply(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None,
           backward: bool) -> tuple[Tensor, Tensor]:
    fits = q.dtype == k.dtype and q.dtype != torch.float64 and cos.dtype in (torch.float32, q.dtype)
    backend = SPEC.select("rope_fwd", q.device) if fits else "reference"
    if position_ids is not None:  # the kernels read int64 (B, T) rows: one copy of B*T ints for q and k
        position_ids = _broadcast_positions(position_ids, q.shape[0], q.shape[2]).to(torch.int64).contiguous()
    return SPEC.call("rope_fwd", backend, q, k, cos, sin, position_ids, backward)


def _forward(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    _check_shapes(q, k, cos, sin, position_ids)
    if position_ids is not None:  # the backward reuses these positions: checking them once here is enough
        _check_positions(position_ids, cos.shape[0])
    return _apply(q, k, cos, sin, position_ids, backward=False)


@torch.library.custom_op("shardkit::rope", mutates_args=())
def _rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    return _forward(q, k, cos, sin, position_ids)


@torch.library.custom_op("shardkit::rope_backward", mutates_args=())
def _rope_backward_op(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor,
                      position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    return _apply(dq, dk, cos, sin, position_ids, backward=True)


@_rope_op.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    _check_shapes(q, k, cos, sin, position_ids)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@_rope_backward_op.register_fake
def _(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _setup_context(ctx, inputs, output) -> None:
    _q, _k, cos, sin, position_ids = inputs
    ctx.save_for_backward(cos, sin, position_ids)


def _backward(ctx, dq: Tensor, dk: Tensor):
    cos, sin, position_ids = ctx.saved_tensors
    gq, gk = _rope_backward_op(dq, dk, cos, sin, position_ids)
    return gq, gk, None, None, None


_rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
         position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Apply rotary embeddings to query and key in one call (HF ``apply_rotary_pos_emb`` semantics).

    Args:
        q: queries (B, Hq, T, D).
        k: keys (B, Hk, T, D).
        cos: (1 or B, T, D), or (max_position, D) when ``position_ids`` is given.
        sin: same shape as ``cos``.
        position_ids: optional integer positions indexing rows of ``cos``/``sin``, any shape that broadcasts
            to (B, T): (T,), (1, T) or (B, T). Without it a 2-D ``cos``/``sin`` (max_position, D) is used for
            positions 0..T-1.

    Returns:
        ``(q_rotated, k_rotated)``, contiguous, same shapes and dtypes as ``q`` and ``k``.

    Raises:
        ValueError: shapes that do not fit, including a (max_position, D) table shorter than T.
        IndexError: a position outside the table (CPU; on CUDA a device-side assert, see ``_check_positions``).
    """
    if position_ids is None and cos.dim() == 2:
        T = q.shape[2]
        if cos.shape[0] < T:
            raise ValueError(f"rope: cos/sin table length {cos.shape[0]} < sequence length {T} (positions 0..{T - 1}):"
                             f" build the rotary table for at least {T} positions (e.g. RotaryEmbedding("
                             f"max_position={T}))")
        cos, sin = cos[:T].unsqueeze(0), sin[:T].unsqueeze(0)
    op = _forward if direct_call_ok(q, k, cos, sin, position_ids) else _rope_op
    return op(q, k, cos, sin, position_ids)


def _example(device: str, dtype: torch.dtype, size: str) -> tuple:
    b, h, t, d = (4, 32, 1024, 128) if size == "bench" else (2, 3, 5, 8)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * (1e-4 ** (torch.arange(d // 2) / (d // 2)))[None]
    emb = torch.cat((ang, ang), -1)[None].to(device)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, t, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
    return q, k, emb.cos(), emb.sin()


SPEC = register(OpSpec(
    name="rope", function=rope, reference=rope_reference, csrc="rope",
    # backward=True applies the transpose of the rotation: one kernel serves both directions
    kernels={"rope_fwd": {"reference": _reference_rope, "triton": "shardkit.kernels.rope:rope_apply",
                          **native("rope_fwd")}},
    triton_checks="shardkit.kernels.rope:compile_checks", example=_example))
