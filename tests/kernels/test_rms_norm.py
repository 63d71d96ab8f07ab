"""RMSNorm: every backend present vs the float64 reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from shardkit.ops import rms_norm, rms_norm_reference

SHAPES = [(2, 8), (3, 5, 37), (5, 123, 123), (4, 1024)]


def _grads(fn, x, w, dy):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_matches_fp64_reference(backend, shape, dtype, offset, make_rand, check_close):
    if backend.interpreted and shape[-1] > 256:
        pytest.skip("Triton interpreter: tiny shapes only")
    eps = 1e-6
    x = make_rand(*shape, dtype=dtype, device=backend.device, seed=1, scale=2.0)
    w = make_rand(shape[-1], dtype=dtype, device=backend.device, seed=2)
    dy = make_rand(*shape, dtype=dtype, device=backend.device, seed=3)

    out = _grads(lambda a, b: rms_norm(a, b, eps, offset), x, w, dy)
    lowp = _grads(lambda a, b: rms_norm_reference(a, b, eps, offset), x, w, dy)
    ref = _grads(lambda a, b: rms_norm_reference(a, b, eps, offset), x.double(), w.double(), dy.double())
    rows = x.numel() // shape[-1]
    for name, got, low, exact in zip(("y", "dx", "dw"), out, lowp, ref):
        # dw sums `rows` products of O(1) values: its absolute slack grows like the sum, ~rows * 1e-7 in fp32
        atol = None if name != "dw" or dtype != torch.float32 else 1e-5 + rows * 2e-7
        check_close(got, low, exact, atol=atol, name=name)


def test_rms_norm_saves_only_rstd_per_row(backend):
    """Backward keeps x, weight and one fp32 rstd per row: no normalised copy of x."""
    x = torch.randn(3, 5, 16, device=backend.device, requires_grad=True)
    w = torch.randn(16, device=backend.device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = rms_norm(x, w)
    assert sorted(t.numel() for t in saved) == sorted([x.numel(), w.numel(), 15]), [t.shape for t in saved]
    assert y.shape == x.shape


def test_rms_norm_mixed_dtypes(backend, make_rand, check_close):
    """fp32 weight with bf16 activations (a common AMP layout): bf16 out and dx, fp32 dw, all near float64."""
    x = make_rand(5, 37, dtype=torch.bfloat16, device=backend.device, seed=1, scale=2.0)
    w = make_rand(37, device=backend.device, seed=2)
    dy = make_rand(5, 37, dtype=torch.bfloat16, device=backend.device, seed=3)
    out = _grads(rms_norm, x, w, dy)
    lowp = _grads(rms_norm_reference, x, w, dy)
    ref = _grads(rms_norm_reference, x.double(), w.double(), dy.double())
    assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for name, got, low, exact in zip(("y", "dx", "dw"), out, lowp, ref):
        check_close(got, low, exact, name=name)


def test_rms_norm_rejects_a_weight_of_the_wrong_size(backend):
    """A weight shorter than x's last dim would make a kernel read past it: a clear error instead."""
    x = torch.randn(4, 32, device=backend.device)
    with pytest.raises(ValueError, match=r"weight of shape \(16,\) does not match x of shape \(4, 32\)"):
        rms_norm(x, torch.randn(16, device=backend.device))


def test_native_rms_norm_checks_the_weight_size_itself():
    """The C++ op, called directly (bypassing the Python check), refuses a mismatched weight too."""
    from shardkit.ops import available_backends

    if "cpp" not in available_backends("cpu", "rms_norm_fwd"):
        pytest.skip("the C++ extension is not built here")
    with pytest.raises(RuntimeError, match="x last dim 32 != weight size 16"):
        torch.ops.shardkit_C.rms_norm_fwd(torch.randn(4, 32), torch.randn(16), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="x last dim 32 != weight size 16"):
        torch.ops.shardkit_C.rms_norm_bwd(torch.randn(4, 32), torch.randn(4, 32), torch.randn(16), torch.ones(4), 0.0)
