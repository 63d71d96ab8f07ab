"""LayerNorm: every backend present vs the float64 reference (output, dx, dweight, dbias), with and without bias,
plus its errors."""

from __future__ import annotations

import pytest
import torch

from shardkit.ops import layer_norm, layer_norm_reference

SHAPES = [(1, 7), (3, 5, 37), (5, 123)]


def _run(fn, x, w, b, dy):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = fn(*leaves, eps=1e-5)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layer_norm_matches_fp64_reference(backend, shape, dtype, bias, make_rand, check_close):
    n = shape[-1]
    x = make_rand(*shape, dtype=dtype, seed=1, scale=2.0) + 0.5  # a non-zero mean to subtract
    w = make_rand(n, dtype=dtype, seed=2)
    b = make_rand(n, dtype=dtype, seed=3) if bias else None
    dy = make_rand(*shape, dtype=dtype, seed=4)
    got = _run(layer_norm, x, w, b, dy)
    low = _run(layer_norm_reference, x, w, b, dy)
    exact = _run(layer_norm_reference, x.double(), w.double(), None if b is None else b.double(), dy.double())
    for name, g, lo, ex in zip(("y", "dx", "dweight", "dbias"), got, low, exact):
        check_close(g, lo, ex, name=name)


def test_layer_norm_matches_torch_module():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(33, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(4, 33)
    torch.testing.assert_close(layer_norm(x, ln.weight, ln.bias, eps=1e-6), ln(x))


def test_layer_norm_names_a_mismatched_weight():
    with pytest.raises(ValueError, match=r"layer_norm: bias of shape \(7,\) does not match x of shape \(2, 8\)"):
        layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(7))
