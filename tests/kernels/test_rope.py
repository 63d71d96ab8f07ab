"""RoPE: every backend present vs the float64 reference, forward and backward, each layout flag; shape and position
errors raised alike on every backend."""

from __future__ import annotations

import pytest
import torch

from shardkit.nn import RotaryEmbedding
from shardkit.ops import rope, rope_reference

# (B, Hq, Hk, T, D): GQA head counts, an odd half-dim (D = 6) and the odd (5, 123, ...) shape
SHAPES = [(1, 2, 1, 3, 8), (2, 3, 3, 7, 6), (5, 4, 2, 123, 64)]


def _run(fn, q, k, dq, dk):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    qo, ko = fn(q, k)
    torch.autograd.backward((qo, ko), (dq, dk))
    return qo.detach(), ko.detach(), q.grad, k.grad


def _check_vs_reference(q, k, cos, sin, pos, make_rand, check_close, ref_pos=None):
    """rope forward + backward vs the reference at q's dtype and in float64, at ``ref_pos`` (default ``pos``)."""
    dq = make_rand(*q.shape, dtype=q.dtype, device=q.device, seed=6)
    dk = make_rand(*k.shape, dtype=k.dtype, device=k.device, seed=7)
    # sin with unequal halves (random): the backward is checked as the true transpose, not just "-sin"
    ref_pos = pos if ref_pos is None else ref_pos
    out = _run(lambda a, b: rope(a, b, cos, sin, pos), q, k, dq, dk)
    lowp = _run(lambda a, b: rope_reference(a, b, cos, sin, ref_pos), q, k, dq, dk)
    ref = _run(lambda a, b: rope_reference(a, b, cos.double(), sin.double(), ref_pos), q.double(), k.double(),
               dq.double(), dk.double())
    for name, got, low, exact in zip(("q", "k", "dq", "dk"), out, lowp, ref):
        check_close(got, low, exact, name=name)


def _inputs(shape, dtype, device, layout, make_rand, table_dtype=None):
    """q, k of ``dtype``; cos, sin of ``table_dtype`` (default ``dtype``); position_ids (B, T) or None."""
    table_dtype = dtype if table_dtype is None else table_dtype
    B, Hq, Hk, T, D = shape
    if layout == "hf_transposed":  # HF: (B, T, H, D) projections viewed as (B, H, T, D)
        q = make_rand(B, T, Hq, D, dtype=dtype, device=device, seed=1).transpose(1, 2)
        k = make_rand(B, T, Hk, D, dtype=dtype, device=device, seed=2).transpose(1, 2)
    else:
        q = make_rand(B, Hq, T, D, dtype=dtype, device=device, seed=1)
        k = make_rand(B, Hk, T, D, dtype=dtype, device=device, seed=2)
    if layout == "position_ids":
        max_pos = T + 5
        cos = make_rand(max_pos, D, dtype=table_dtype, device=device, seed=3)
        sin = make_rand(max_pos, D, dtype=table_dtype, device=device, seed=4)
        gen = torch.Generator().manual_seed(5)
        pos = torch.randint(0, max_pos, (B, T), generator=gen).to(device)
    else:
        cs_b = B if layout == "batch_cos" else 1
        cos = make_rand(cs_b, T, D, dtype=table_dtype, device=device, seed=3)
        sin = make_rand(cs_b, T, D, dtype=table_dtype, device=device, seed=4)
        pos = None
    return q, k, cos, sin, pos


@pytest.mark.parametrize("layout", ["shared_cos", "batch_cos", "position_ids", "hf_transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_matches_fp64_reference(backend, shape, dtype, layout, make_rand, check_close):
    if backend.interpreted and shape[3] > 8:
        pytest.skip("Triton interpreter: tiny shapes only")
    q, k, cos, sin, pos = _inputs(shape, dtype, backend.device, layout, make_rand)
    _check_vs_reference(q, k, cos, sin, pos, make_rand, check_close)


@pytest.mark.parametrize("layout", ["shared_cos", "position_ids"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_low_precision_qk_with_fp32_tables(backend, shape, dtype, layout, make_rand, check_close):
    """RotaryEmbedding's path: bf16/fp16 q and k with its fp32 cos/sin tables (mixed storage in the kernels)."""
    if backend.interpreted and shape[3] > 8:
        pytest.skip("Triton interpreter: tiny shapes only")
    q, k, cos, sin, pos = _inputs(shape, dtype, backend.device, layout, make_rand, table_dtype=torch.float32)
    _check_vs_reference(q, k, cos, sin, pos, make_rand, check_close)


# B > 1 with GQA heads (Hq = 4, Hk = 2), an odd half-dim, and the odd (5, ..., 123, 64) shape
BROADCAST_SHAPES = [(3, 4, 2, 5, 6), (5, 4, 2, 123, 64)]


@pytest.mark.parametrize("pos_shape", ["T", "1T", "BT"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_position_ids_broadcast_with_gqa(backend, shape, dtype, pos_shape, make_rand, check_close):
    """position_ids (T,) and (1, T) (what HF builds for a batch) act as the same row expanded to (B, T), under GQA."""
    if backend.interpreted and shape[3] > 8:
        pytest.skip("Triton interpreter: tiny shapes only")
    B, Hq, Hk, T, D = shape
    q = make_rand(B, Hq, T, D, dtype=dtype, device=backend.device, seed=1)
    k = make_rand(B, Hk, T, D, dtype=dtype, device=backend.device, seed=2)
    cos = make_rand(T + 5, D, dtype=torch.float32, device=backend.device, seed=3)
    sin = make_rand(T + 5, D, dtype=torch.float32, device=backend.device, seed=4)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(0, T + 5, (B if pos_shape == "BT" else 1, T), generator=gen).to(backend.device)
    pos = rows[0] if pos_shape == "T" else rows
    # the references get explicit (B, T) positions: they do not rely on the broadcast under test
    _check_vs_reference(q, k, cos, sin, pos, make_rand, check_close, ref_pos=rows.expand(B, T).contiguous())


@pytest.mark.parametrize("bad", [16, 1000, -1])
def test_rope_out_of_range_positions_raise(backend, bad):
    """A position outside the (16, D) table raises on every CPU backend instead of reading past the table."""
    if backend.device == "cuda":
        pytest.skip("CUDA checks positions with torch._assert_async: a device-side assert, not an exception")
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = torch.randn(16, 8), torch.randn(16, 8)
    pos = torch.arange(5).repeat(2, 1)
    pos[1, 3] = bad
    match = "min -1 < 0" if bad < 0 else f"max {bad} >= cos/sin table length 16: .* at least {bad + 1} positions"
    for p in (pos, pos[1:], pos[1]):  # (B, T), (1, T), (T,)
        with pytest.raises(IndexError, match=match):
            rope(q, k, cos, sin, p)


def test_rope_table_shorter_than_sequence_raises(backend):
    """T > the table's positions (no position_ids) names the fix on every backend instead of reading past it."""
    rot = RotaryEmbedding(head_dim=8, max_position=4).to(backend.device)
    q = torch.randn(2, 3, 6, 8, device=backend.device)
    k = torch.randn(2, 1, 6, 8, device=backend.device)
    with pytest.raises(ValueError, match="table length 4 < sequence length 6 .* at least 6 positions"):
        rot.rotate(q, k)
    with pytest.raises(ValueError, match="without position_ids cos/sin must be"):  # a (1, T', D) slice, T' < T
        rope(q, k, rot.cos_cached[None], rot.sin_cached[None])


@pytest.mark.parametrize("case", ["pos_batch", "pos_length", "pos_3d", "table_3d_with_pos", "head_dim"])
def test_rope_bad_shapes_raise(backend, case):
    """Shapes the kernels cannot index raise the same ValueError on every backend (checked before dispatch)."""
    dev = backend.device
    q, k = torch.randn(3, 2, 5, 8, device=dev), torch.randn(3, 1, 5, 8, device=dev)
    cos, sin = torch.randn(16, 8, device=dev), torch.randn(16, 8, device=dev)
    pos = {"pos_batch": torch.zeros(2, 5), "pos_length": torch.zeros(3, 6), "pos_3d": torch.zeros(1, 3, 5)}.get(
        case, torch.zeros(3, 5))
    if case == "table_3d_with_pos":
        cos, sin = cos[None], sin[None]
    if case == "head_dim":
        cos, sin = cos[:, :6], sin[:, :6]
    with pytest.raises(ValueError, match="rope: "):
        rope(q, k, cos, sin, pos.long().to(dev))


def test_rope_head_offsets_past_int32(backend, make_rand, check_close):
    """Element offsets h * stride(1) past 2^31 (H*T*D > 2^31 in one batch element) are computed in int64.

    q is a (1, 3, 1, 8) bf16 view whose heads lie 2^30 + 64 elements apart, from storage offset 2^31, in a buffer of
    2^32 + 256 elements: 8 GiB of address space of which only the pages of the rows written are ever touched. An
    int32 offset for head 2 wraps by -2^32 elements onto untouched memory inside the buffer (no fault): wrong rows.
    """
    if backend.device == "cuda" and torch.cuda.mem_get_info()[0] < (10 << 30):
        pytest.skip("needs 8 GiB of free GPU memory")
    D, stride_h, offset = 8, (1 << 30) + 64, 1 << 31
    base = torch.empty((1 << 32) + 256, dtype=torch.bfloat16, device=backend.device)
    q = base.as_strided((1, 3, 1, D), (3 * stride_h, stride_h, D, 1), offset)
    q.copy_(make_rand(1, 3, 1, D, dtype=torch.bfloat16, device=backend.device, seed=1))
    k = make_rand(1, 1, 1, D, dtype=torch.bfloat16, device=backend.device, seed=2)
    cos = make_rand(1, 1, D, device=backend.device, seed=3)
    sin = make_rand(1, 1, D, device=backend.device, seed=4)
    qo, ko = rope(q, k, cos, sin)
    q_low, k_low = rope_reference(q, k, cos, sin)
    q64, k64 = rope_reference(q.double(), k.double(), cos.double(), sin.double())
    check_close(qo, q_low, q64, name="q")
    check_close(ko, k_low, k64, name="k")


def test_rotary_embedding_module_matches_hf_tables(backend):
    """RotaryEmbedding.apply with position_ids == HF-style gather of its own (cos, sin) then rope."""
    rot = RotaryEmbedding(head_dim=8, max_position=16).to(backend.device)
    q = torch.randn(2, 3, 5, 8, device=backend.device)
    k = torch.randn(2, 1, 5, 8, device=backend.device)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]], device=backend.device)
    cos, sin = rot(pos)
    assert cos.shape == (2, 5, 8)
    torch.testing.assert_close(cos[..., :4], cos[..., 4:])  # HF duplicated halves
    qo, ko = rot.rotate(q, k, pos)
    qr, kr = rope_reference(q, k, cos, sin)
    torch.testing.assert_close(qo, qr)
    torch.testing.assert_close(ko, kr)
    q0, _ = rot.rotate(q, k)  # default positions 0..T-1
    torch.testing.assert_close(q0, rope_reference(q, k, rot.cos_cached[:5][None], rot.sin_cached[:5][None])[0])
    q1, _ = rot.rotate(q, k, torch.arange(5, device=backend.device)[None])  # HF's (1, T) positions for a batch
    torch.testing.assert_close(q1, q0)
