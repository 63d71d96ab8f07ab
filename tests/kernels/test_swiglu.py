"""SwiGLU: every backend present vs the float64 reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from shardkit.ops import swiglu, swiglu_reference

SHAPES = [(7,), (3, 5, 37), (5, 123, 123), (2, 4100)]


def _grads(fn, g, u, dy):
    g = g.detach().clone().requires_grad_()
    u = u.detach().clone().requires_grad_()
    y = fn(g, u)
    y.backward(dy)
    return y.detach(), g.grad, u.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_swiglu_matches_fp64_reference(backend, shape, dtype, make_rand, check_close):
    g = make_rand(*shape, dtype=dtype, device=backend.device, seed=1, scale=3.0)  # both tails of the sigmoid
    u = make_rand(*shape, dtype=dtype, device=backend.device, seed=2)
    dy = make_rand(*shape, dtype=dtype, device=backend.device, seed=3)
    out = _grads(swiglu, g, u, dy)
    lowp = _grads(swiglu_reference, g, u, dy)
    ref = _grads(swiglu_reference, g.double(), u.double(), dy.double())
    for name, got, low, exact in zip(("y", "dgate", "dup"), out, lowp, ref):
        check_close(got, low, exact, name=name)


def test_swiglu_backward_saves_inputs_not_product(backend):
    """Only gate and up are saved (the linear layers keep them anyway); the product is recomputed."""
    g = torch.randn(4, 64, device=backend.device, requires_grad=True)
    u = torch.randn(4, 64, device=backend.device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(g, u)
    assert len(saved) == 2 and all(t.data_ptr() in (g.data_ptr(), u.data_ptr()) for t in saved)
