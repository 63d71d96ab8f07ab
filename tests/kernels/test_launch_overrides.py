"""The Triton kernels' launch-setting overrides (``shardkit.kernels.<op>.LAUNCH``, swept by benchmarks/gpu_tune.py):
they reach the launch, leave the results unchanged, restore the defaults, and refuse bad settings by name."""

from __future__ import annotations

import pytest
import torch

from shardkit.ops import force_backend
from shardkit.ops._dispatch import triton_runnable
from shardkit.ops.rms_norm import rms_norm, rms_norm_reference

pytestmark = pytest.mark.skipif(not triton_runnable("cpu"), reason="needs TRITON_INTERPRET=1 (set by conftest)")


def _rms(x, w):
    with force_backend("triton"):
        x = x.detach().requires_grad_()
        w = w.detach().requires_grad_()
        y = rms_norm(x, w, 1e-6)
        y.backward(torch.ones_like(y) * 0.5 + x.detach())
        return y.detach(), x.grad, w.grad


def test_rms_norm_override_reaches_launch_and_keeps_results():
    from shardkit.kernels import rms_norm as k
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 40, generator=g), 1 + 0.1 * torch.randn(40, generator=g)
    default = k.launch_settings(40, 13, x.device)
    with k.LAUNCH.override(fwd_warps=8, bwd_warps=2, bwd_programs_per_sm=3):
        assert k.launch_settings(40, 13, x.device) == {"fwd_warps": 8, "bwd_warps": 2, "bwd_programs": 12}
        tuned = _rms(x, w)
    assert k.launch_settings(40, 13, x.device) == default  # restored after the block
    base = _rms(x, w)
    for a, b in zip(tuned, base):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # 12 programs vs 4: only the dw sum order differs
    ref = rms_norm_reference(x.double(), w.double(), 1e-6)
    torch.testing.assert_close(tuned[0].double(), ref, rtol=1e-5, atol=1e-5)


def test_adamw_override_reaches_launch_and_keeps_results():
    from shardkit.kernels import adamw as k
    g = torch.Generator().manual_seed(1)
    n = 3001  # a ragged last block at every BLOCK
    states = [[torch.randn(n, generator=g)], [torch.randn(n, generator=g) * 1e-2], [torch.randn(n, generator=g) * 1e-3],
              [torch.rand(n, generator=g) * 1e-6 + 1e-9]]  # p, grad, exp_avg, exp_avg_sq: none zero

    def step():
        p, gr, m, v = ([t.clone() for t in ts] for ts in states)
        k.adamw_step_(p, gr, m, v, [], [1e-3], [0.1], 1e-3, 0.9, 0.999, 1e-8, 0.01, False)
        return p + m + v

    with k.LAUNCH.override(block=256, num_warps=8):
        assert k.launch_settings(False) == (256, 8)
        tuned = step()
    assert k.launch_settings(False) == (1024, 4)
    for a, b in zip(tuned, step()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # elementwise: the block size changes nothing


@pytest.mark.parametrize(("kw", "error", "says"), [
    ({"fwd_warp": 8}, TypeError, "did you mean 'fwd_warps'"),
    ({"bwd_warps": 3}, ValueError, "bwd_warps=3 is not allowed"),
    ({"bwd_programs_per_sm": "2"}, ValueError, "a str is not allowed"),
])
def test_bad_settings_are_refused_by_name(kw, error, says):
    from shardkit.kernels import rms_norm as k
    with pytest.raises(error, match=says), k.LAUNCH.override(**kw):
        pass
    assert all(v is None for v in k.LAUNCH.settings().values())
