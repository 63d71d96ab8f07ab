"""The grouped experts' autograd function against plain autograd of the same arithmetic: values, every gradient, what it
keeps for the backward, and its engines against each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardkit.models.moe_experts import grouped_mm_works, grouped_swiglu, routed_swiglu

N, H, INTER, E, K = 10, 16, 8, 5, 2


def _problem(dtype=torch.float64, seed=0, empty=3):
    """N tokens routed top-K over E experts, expert ``empty`` getting none; assignments sorted by expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g, dtype=dtype) / 4).requires_grad_()
    down = (torch.randn(E, H, INTER, generator=g, dtype=dtype) / 3).requires_grad_()
    scores = torch.rand(N, E, generator=g, dtype=torch.float64)
    scores[:, empty] = -1
    picked = scores.topk(K, dim=-1).indices
    flat = picked.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    weights = torch.rand(N * K, generator=g, dtype=dtype)[order].requires_grad_()
    return x, gate_up, down, weights, order // K, torch.bincount(flat, minlength=E)


def _plain(x, gate_up, down, weights, token, counts):
    """The same function through plain autograd, one expert at a time."""
    rows = x[token]
    outs = []
    for e, chunk in enumerate(torch.split(rows, counts.tolist())):
        gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
    out = torch.cat(outs) * weights.unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, token, out)


def _routed(backend):
    return lambda x, gu, dn, w, token, counts: routed_swiglu(x, token, w, counts, gu, dn, backend=backend)


def _value_and_grads(fn, inputs, wrt=4):
    out = fn(*inputs)
    probe = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return (out.detach(), *torch.autograd.grad((out * probe).sum(), inputs[:wrt]))


@pytest.mark.parametrize("backend", ["loop", "bmm", "auto"])
def test_routed_experts_equal_plain_autograd_in_fp64(backend):
    inputs = _problem()
    want = _value_and_grads(_plain, inputs)
    got = _value_and_grads(_routed(backend), inputs)
    for name, a, b in zip(("out", "x", "gate_up", "down", "weights"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)
    assert got[2][3].abs().max() == 0 and got[3][3].abs().max() == 0  # the empty expert: zero gradients
    # the sorted-rows form (what expert parallelism runs): the SwiGLU per assignment, unweighted
    x, gate_up, down, _, token, counts = inputs
    rows = x.detach()[token].requires_grad_()

    def plain_rows(r, gu, dn):
        return _plain(r, gu, dn, torch.ones(r.shape[0], dtype=r.dtype), torch.arange(r.shape[0]), counts)

    want = _value_and_grads(plain_rows, (rows, gate_up, down), wrt=3)
    got = _value_and_grads(lambda r, gu, dn: grouped_swiglu(r, counts, gu, dn, backend=backend), (rows, gate_up, down),
                           wrt=3)
    for name, a, b in zip(("out", "rows", "gate_up", "down"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.skipif(not grouped_mm_works("cpu", torch.float32), reason="torch._grouped_mm does not run here")
def test_the_grouped_mm_engine_equals_the_loop_engine():
    """One grouped GEMM of every expert (the GPU form; an empty expert among them) against one matmul per expert."""
    inputs = _problem(torch.float32, seed=1, empty=2)
    loop = _value_and_grads(_routed("loop"), inputs)
    grouped = _value_and_grads(_routed("grouped_mm"), inputs)
    for name, a, b in zip(("out", "x", "gate_up", "down", "weights"), grouped, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(RuntimeError, match="experts_backend='grouped_mm'.*'loop'"):
        _routed("grouped_mm")(*[t.double() for t in inputs[:4]], *inputs[4:])


def _saved_bytes(fn, inputs) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn(*inputs)``, past the inputs' own storage."""
    own = {t.untyped_storage().data_ptr() for t in inputs}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(kept.values())


def test_routed_experts_keep_only_the_gate_up_projection_for_the_backward():
    inputs = _problem(torch.float32)
    ours = _saved_bytes(_routed("loop"), inputs)
    plain = _saved_bytes(_plain, inputs)
    # the (S, 2I) projection and the experts' end rows; no sorted copy of the tokens, activation or expert outputs
    assert ours == N * K * 2 * INTER * 4 + E * 8, ours
    assert plain >= 2.5 * ours, (plain, ours)


def test_low_precision_sums_run_in_fp32_and_bad_counts_are_named():
    x, gate_up, down, weights, token, counts = _problem()
    want = _plain(x, gate_up, down, weights, token, counts).detach()
    got = _routed("loop")(*(t.detach().bfloat16() for t in (x, gate_up, down, weights)), token, counts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="counts add up to 19 assignments for 20 rows"):
        _routed("loop")(x, gate_up, down, weights, token, counts - F.one_hot(torch.tensor(0), E))
    moved = counts + F.one_hot(torch.tensor(0), E) - F.one_hot(torch.tensor(1), E) * (counts[1] + 1)
    moved[2] += counts[1]  # still adds up to the rows: expert 1's run would overlap its neighbours'
    with pytest.raises(ValueError, match="expert 1 has a negative count"):
        _routed("loop")(x, gate_up, down, weights, token, moved)
    with pytest.raises(ValueError, match="not one of"):
        routed_swiglu(x, token, weights, counts, gate_up, down, backend="grouped")
