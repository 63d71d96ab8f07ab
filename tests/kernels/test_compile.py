"""torch.compile(fullgraph=True) over a tiny module using all three ops: fake impls and autograd on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.nn import RMSNorm, RotaryEmbedding, SwiGLUMLP


class _Block(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm = RMSNorm(hidden)
        self.gemma_norm = RMSNorm(hidden, offset=1.0)
        self.qk = nn.Linear(hidden, 2 * hidden, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, max_position=16)
        self.mlp = SwiGLUMLP(hidden, 48)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k = self.qk(self.norm(x)).view(B, T, 2, self.heads, self.head_dim).unbind(2)
        q, k = self.rotary.rotate(q.transpose(1, 2), k.transpose(1, 2), position_ids)
        x = x + (q * k).transpose(1, 2).reshape(B, T, C)
        return x + self.mlp(self.gemma_norm(x))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(compile_backend):
    torch.manual_seed(0)
    model = _Block()
    for p in model.parameters():  # random (non-identity) norm weights
        nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 5, 32, requires_grad=True)
    pos = torch.arange(3, 8).expand(2, 5)
    eager = model(x, pos)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    out = compiled(x, pos)
    (g_out,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_out, g_eager, rtol=1e-5, atol=1e-5)


def test_inference_skips_the_custom_ops_with_the_same_results_and_still_compiles(monkeypatch):
    # Eager calls that want no gradient run the op's implementation directly (its torch.library wrapper costs
    # ~15 us a call on an idle CPU); with gradients, and under torch.compile, the custom ops are used as before.
    import importlib

    calls = []
    for module, owner, attr in (("rms_norm", None, "_rms_norm_op"), ("rope", None, "_rope_op"),
                                ("swiglu", "_GLU", "op")):
        mod = importlib.import_module(f"shardkit.ops.{module}")
        target = getattr(mod, owner) if owner else mod
        op = getattr(target, attr)
        monkeypatch.setattr(target, attr, lambda *a, _op=op, _name=module: calls.append(_name) or _op(*a))
    torch.manual_seed(0)
    model = _Block().eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.5)
    x, pos = torch.randn(2, 5, 32), torch.arange(3, 8).expand(2, 5)
    with_grad = model(x, pos)
    assert sorted(set(calls)) == ["rms_norm", "rope", "swiglu"] and with_grad.requires_grad
    calls.clear()
    with torch.no_grad():
        direct = model(x, pos)
        assert calls == []  # no custom op on the eager inference path
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x, pos)
    assert torch.equal(direct, with_grad.detach())
    torch.testing.assert_close(compiled, direct, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        assert torch.equal(model(x, pos), direct)
