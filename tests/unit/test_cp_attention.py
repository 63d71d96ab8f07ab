"""Ring attention's fused per-block path, in one process: the ranks of the ring are threads and the ring shift an
in-memory exchange, so the block plan, the log-sum-exp merge and the ring-flash backward are checked against
fp64 causal attention of the whole sequence without launching a process group."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from shardkit.strategies import cp_attention
from shardkit.strategies.cp_attention import RingAttention, _block_plan, _fused_ops, _Ring, load_balanced_positions


def _ring(cp: int, rank: int, seq_len: int) -> RingAttention:
    ring = RingAttention.__new__(RingAttention)
    ring.group, ring.size, ring.rank, ring.seq_len = None, cp, rank, seq_len
    return ring


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_block_plan_covers_exactly_the_causal_mask(cp):
    seq = 8 * cp
    for rank in range(cp):
        ring = _ring(cp, rank, seq)
        q_pos = ring.positions(rank, torch.device("cpu"))
        for step in range(cp):
            rows, keys, causal = _block_plan(ring, step)
            planned = torch.zeros(len(q_pos), len(q_pos), dtype=torch.bool)
            n_rows, n_keys = planned[rows, keys].shape
            block = torch.ones(n_rows, n_keys, dtype=torch.bool)
            planned[rows, keys] = block.tril() if causal else block
            assert torch.equal(planned, ring.visible(q_pos, step)), (cp, rank, step)


def _simulated_shift(cp: int):
    """``_shift`` for ``cp`` threads: rank r's tensor to r + step, r - step's back (a barrier each side)."""
    slots: list = [None] * cp
    barrier = threading.Barrier(cp)
    local = threading.local()

    def shift(t, group, step):
        barrier.wait()
        slots[(local.rank + step) % cp] = t
        barrier.wait()
        return slots[local.rank]

    return shift, local, barrier


def _run_ring(cp: int, q, k, v, grad, monkeypatch):
    """Each rank's (out, dq, dk, dv) of its load-balanced chunks, ranks run as threads."""
    shift, local, barrier = _simulated_shift(cp)
    monkeypatch.setattr(cp_attention, "_shift", shift)
    # the fused ring posts a transfer and waits on it later: here it completes at once (every rank posts in the
    # same order, so the barriers still pair them up)
    monkeypatch.setattr(cp_attention, "_post", lambda t, group, step: (lambda got=shift(t, group, step): got))
    seq = q.shape[2]
    results: list = [None] * cp
    errors: list = []

    def rank_main(rank):
        local.rank = rank
        try:
            pos = load_balanced_positions(seq, cp, rank)
            ql, kl, vl = (t[:, :, pos].detach().requires_grad_() for t in (q, k, v))
            out = _Ring.apply(ql, kl, vl, _ring(cp, rank, seq))
            out.backward(grad[:, :, pos])
            results[rank] = (pos, out.detach(), ql.grad, kl.grad, vl.grad)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)
            barrier.abort()  # the other ranks stop waiting on this one

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    gathered = [torch.zeros_like(t) for t in (q, q, k, v)]
    for pos, *parts in results:
        for whole, part in zip(gathered, parts):
            whole[:, :, pos] = part
    return gathered


_CASES = [("cpu", torch.float64, 1e-10), ("cpu", torch.float32, 2e-5), ("cpu", torch.bfloat16, 2e-2),
          # the GPU session (scripts/gpu_session.sh) runs these: the flash op per block, and fp32's math path
          ("cuda", torch.bfloat16, 2e-2), ("cuda", torch.float16, 4e-3), ("cuda", torch.float32, 2e-5)]


@pytest.mark.parametrize("cp", [1, 3])
@pytest.mark.parametrize("device, dtype, tol", _CASES, ids=[f"{d}-{str(t)[6:]}" for d, t, _ in _CASES])
def test_fused_ring_equals_fp64_causal_attention_with_gradients(cp, device, dtype, tol, monkeypatch):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    gen = torch.Generator().manual_seed(cp)
    b, h, seq, d = 2, 3, 12 * cp, 8
    q, k, v, grad = (torch.randn(b, h, seq, d, generator=gen, dtype=torch.float64) for _ in range(4))
    if device == "cuda":
        q, k, v, grad = (t.cuda() for t in (q, k, v, grad))
        fused = "flash" if dtype != torch.float32 and torch.cuda.get_device_capability() >= (8, 0) else None
        cp_attention._warn_once.cache_clear()  # it warns once per process
        with pytest.warns(UserWarning, match="math path") if fused is None else contextlib.nullcontext():
            assert _fused_ops(q.to(dtype)) == fused
    else:
        assert _fused_ops(q.to(dtype)) == "cpu"
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = (ref[0] @ ref[1].transpose(-1, -2)) * d ** -0.5
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ ref[2]
    expected.backward(grad)
    got = _run_ring(cp, *(t.to(dtype) for t in (q, k, v, grad)), monkeypatch)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, (expected, *(t.grad for t in ref))):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.double(), e.detach(), atol=tol, rtol=tol, msg=name)
