"""Standalone cross-entropy (gradient computed in the forward): every backend present vs the float64 reference
for each reduction, ignore_index, label smoothing and softcap; what it saves; its errors."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from fresh_process import in_fresh_process

from benchmarks._timing import peak_memory
from shardkit.ops import cross_entropy, cross_entropy_reference, force_backend

ce_module = importlib.import_module("shardkit.ops.cross_entropy")  # the package re-exports the function's name


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


def test_cross_entropy_saves_nothing_of_the_logits_size():
    """The graph saves neither the logits nor their gradient (the gradient, computed in the forward, is held by
    the op until its backward hands it on); torch's F.cross_entropy saves its log-softmax; a second backward
    raises."""
    logits = torch.randn(6, 50, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 50, (6,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = cross_entropy(logits, target)
    assert not [t for t in saved if t.numel() == logits.numel()]
    loss = cross_entropy(logits, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*compute the loss again"):
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


@pytest.mark.parametrize("kw", [{}, {"reduction": "none", "label_smoothing": 0.1}, {"softcap": 3.0}],
                         ids=["mean", "none-smoothing", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_overwrite_logits_matches_fp64_reference(backend, dtype, kw, make_rand, check_close):
    """``overwrite_logits=True`` on an intermediate: same loss and gradient, and the logits' own buffer now holds
    the gradient (Liger-Kernel's form)."""
    n, v = 9, 37
    logits = make_rand(n, v, dtype=dtype, seed=1, scale=3.0)
    target = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(2)).to(backend.device)
    target[:2] = -100
    upstream = make_rand(n, seed=3)
    z0 = logits.detach().clone().requires_grad_()
    z = z0 * 1  # an intermediate, as lm_head's output
    loss = cross_entropy(z, target, overwrite_logits=True, **kw)
    (loss * upstream[: loss.numel()].view(loss.shape)).sum().backward()
    low = _run(cross_entropy_reference, logits, target, upstream, **kw)
    exact = _run(cross_entropy_reference, logits.double(), target, upstream.double(), **kw)
    check_close(loss.detach(), low[0], exact[0], name="loss")
    check_close(z0.grad, low[1], exact[1], name="dlogits")
    torch.testing.assert_close(z.detach(), z0.grad, rtol=0, atol=0)


def test_cross_entropy_overwrite_refused_where_the_logits_are_held():
    """Leaves, views of leaves and strided logits keep their values: the gradient goes to a new buffer."""
    target = torch.tensor([1, 2, 3, 0])
    leaf = torch.randn(4, 8, requires_grad=True)
    for logits in (leaf, leaf.view(4, 8), (torch.randn(8, 4, requires_grad=True) * 1).t()):
        kept = logits.detach().clone()
        cross_entropy(logits, target, overwrite_logits=True).backward()
        torch.testing.assert_close(logits.detach(), kept, rtol=0, atol=0)


def _peak_ratio(make_logits, target, size: int, warm: bool = True, **kw) -> float:
    """CPU peak of forward+backward over what was live before, in units of the logits' size (RSS high-water:
    at 62.5 MiB every tensor of the logits' size is its own mmap, so it counts once, exactly)."""
    held: list[torch.Tensor] = []

    def setup():
        held.clear()
        held.append(make_logits())

    def run():
        logits = held.pop()
        cross_entropy(logits, target, **kw).backward()
        del logits

    if warm:  # first-call buffers out of the window
        setup()
        run()
    return peak_memory(run, "cpu", setup) / size


def overwrite_peaks(dtype_name: str) -> tuple[float, float]:
    """CPU peaks of forward+backward in units of the logits: out of place on leaf logits, and overwriting."""
    ce_module._CHUNK_BYTES = 4 * 2**20  # a fresh process of its own (fresh_process.py): nothing to restore
    dtype = getattr(torch, dtype_name)
    n, v = 512 * 4 // dtype.itemsize, 32000
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, v, (n,), generator=gen)
    h = torch.randn(n, 16, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, 16, generator=gen) / 4).to(dtype)
    logits = (h @ w.T).detach()
    size = logits.numel() * logits.element_size()
    with force_backend("reference"):
        out_of_place = _peak_ratio(lambda: logits.detach().clone().requires_grad_(), target, size)
        over = _peak_ratio(lambda: h @ w.T, target, size, warm=False, overwrite_logits=True)  # lm_head's output
    return out_of_place, over


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resident-set accounting")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["fp32", "bf16"])
def test_cross_entropy_forward_backward_allocates_no_logits_sized_tensor_when_overwriting(dtype):
    """62.5 MiB of logits at the H200 run's vocabulary (32000): out of place one buffer of the logits' size (it
    becomes the leaf's .grad without a copy; before: 2.0x in fp32, 5x in bf16 where the fp32 scale of the bf16
    gradient was materialised whole), over lm_head's output with overwrite_logits none (< 0.5x: chunk
    temporaries only). Liger-Kernel: ~0 (it writes over the logits). 4 MiB chunks: the CPU reference's row pass
    allocates a few chunk-sized temporaries (the Triton kernel none), kept small beside the logits."""
    out_of_place, over = in_fresh_process("test_cross_entropy", "overwrite_peaks", dtype)
    assert 0.9 < out_of_place < 1.5, out_of_place
    assert over < 0.5, over
