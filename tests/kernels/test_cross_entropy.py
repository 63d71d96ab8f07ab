"""Standalone cross-entropy (gradient computed in the forward): every backend present vs the float64 reference
for each reduction, ignore_index, label smoothing and softcap; what it saves; its errors."""

from __future__ import annotations

import pytest
import torch

from shardkit.ops import cross_entropy, cross_entropy_reference


def _run(fn, logits, target, upstream, **kw):
    z = logits.detach().clone().requires_grad_()
    loss = fn(z, target, **kw)
    (loss * upstream[: loss.numel()].view(loss.shape)).sum().backward()  # a non-uniform upstream for "none"
    return loss.detach(), z.grad


@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1},
                                {"softcap": 3.0, "ignore_index": 5}],
                         ids=["mean", "sum", "none", "smoothing", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_matches_fp64_reference(backend, dtype, kw, make_rand, check_close):
    n, v = 9, 37
    logits = make_rand(2, n, v, dtype=dtype, seed=1, scale=3.0)
    target = torch.randint(0, v, (2, n), generator=torch.Generator().manual_seed(2)).to(backend.device)
    target[0, :3] = kw.get("ignore_index", -100)  # ignored rows: no loss, no gradient
    upstream = make_rand(2 * n, seed=3)
    got = _run(cross_entropy, logits, target, upstream, **kw)
    low = _run(cross_entropy_reference, logits, target, upstream, **kw)
    exact = _run(cross_entropy_reference, logits.double(), target, upstream.double(), **kw)
    assert got[0].dtype == torch.float32  # the loss in fp32 whatever the logits' dtype, as HF's
    check_close(got[0], low[0], exact[0], name="loss")
    check_close(got[1], low[1], exact[1], name="dlogits")
    assert got[1][0, :3].abs().max() == 0


def test_cross_entropy_saves_one_logits_sized_gradient_not_the_logits():
    """The graph keeps d loss/d logits in the logits' dtype (computed in the forward), nothing else of that size;
    torch's F.cross_entropy keeps its log-softmax (the same size); a second backward raises."""
    logits = torch.randn(6, 50, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 50, (6,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = cross_entropy(logits, target)
    big = [t for t in saved if t.numel() == logits.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16 and big[0].data_ptr() != logits.data_ptr()
    loss = cross_entropy(logits, target)  # outside the hooks (they bypass autograd's version check)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_cross_entropy_without_grad_and_all_ignored():
    logits, target = torch.randn(4, 11), torch.full((4,), -100)
    with torch.no_grad():
        assert torch.isnan(cross_entropy(logits, target))  # mean over no rows: nan, as torch
        assert cross_entropy(logits, target, reduction="sum") == 0


def test_cross_entropy_errors_name_the_problem():
    logits = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"cross_entropy: label 8 at row 1 is outside \[0, 8\)"):
        cross_entropy(logits, torch.tensor([0, 8, 1]))
    with pytest.raises(ValueError, match="reduction='avg'.*mean"):
        cross_entropy(logits, torch.tensor([0, 1, 2]), reduction="avg")
    with pytest.raises(ValueError, match="one target per row"):
        cross_entropy(logits, torch.tensor([0, 1]))
