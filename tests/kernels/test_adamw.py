"""FusedAdamW on every backend against torch.optim.AdamW over 100 steps of random problems."""

from __future__ import annotations

import io

import pytest
import torch

from shardkit.ops import force_backend
from shardkit.ops._dispatch import triton_runnable
from shardkit.optim import FusedAdamW


def _params(make_rand, dtype, device, seed=0):
    # odd sizes: a ragged last block / chunk for every kernel; 70001 spans two 64 Ki-element C++ chunks
    shapes = [(37, 13), (257,), (70001,)]
    return [make_rand(*s, dtype=torch.float32, device=device, seed=seed + i) for i, s in enumerate(shapes)]


def _run(backend_steps, make_rand, dtype, weight_decay=1e-2, maximize=False, steps=100, scheduler=False,
         master_weights=None, device="cpu"):
    base = _params(make_rand, dtype, device)
    ref = [p.clone().requires_grad_() for p in base]
    mine = [p.clone().to(dtype).requires_grad_() for p in base]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, maximize=maximize)
    o_ref = torch.optim.AdamW([{"params": ref[:2]}, {"params": ref[2:], "lr": 3e-3}], **kw)
    o_mine = FusedAdamW([{"params": mine[:2]}, {"params": mine[2:], "lr": 3e-3}], master_weights=master_weights, **kw)
    scheds = []
    if scheduler:
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.05 * s)) for o in (o_ref, o_mine)]
    gen = torch.Generator().manual_seed(123)
    for _ in range(steps):
        for r, m in zip(ref, mine):
            g = torch.randn(r.shape, generator=gen).to(device)
            r.grad, m.grad = g.clone(), g.to(dtype)
        o_ref.step()
        backend_steps(o_mine)
        for s in scheds:
            s.step()
    return ref, mine, o_ref, o_mine


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("scheduler", [False, True])
def test_fp32_matches_torch_adamw(backend, make_rand, weight_decay, maximize, scheduler):
    steps = 8 if backend.interpreted else 100
    ref, mine, o_ref, o_mine = _run(lambda o: o.step(), make_rand, torch.float32, weight_decay, maximize, steps,
                                    scheduler, device=backend.device)
    for r, m in zip(ref, mine):
        torch.testing.assert_close(m, r, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(o_mine.state[m]["exp_avg"], o_ref.state[r]["exp_avg"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(o_mine.state[m]["exp_avg_sq"], o_ref.state[r]["exp_avg_sq"], atol=1e-7, rtol=1e-5)
        assert o_mine.state[m]["step"].item() == o_ref.state[r]["step"].item() == steps
        assert o_mine.state[m]["step"].dtype == o_ref.state[r]["step"].dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_master_weights_track_fp32(backend, make_rand, dtype):
    steps = 8 if backend.interpreted else 100
    ref, mine, _, o_mine = _run(lambda o: o.step(), make_rand, dtype, 0.1, steps=steps, device=backend.device)
    for r, m in zip(ref, mine):
        state = o_mine.state[m]
        assert state["master_param"].dtype == state["exp_avg"].dtype == torch.float32 and m.dtype == dtype
        # gradients were rounded to 16 bits: the fp32 master drifts slightly from the fp32 run
        torch.testing.assert_close(state["master_param"], r.detach(), atol=3e-2, rtol=0)
        # the param is the master rounded to its dtype
        torch.testing.assert_close(m.detach(), state["master_param"].to(dtype), atol=0, rtol=0)


def test_master_weights_beat_direct_bf16_updates(make_rand):
    # Small lr: each update (1e-4) is far below half a bf16 ulp at |p| ~ 4 (0.0156), so without a
    # master copy every update rounds away; the fp32 master accumulates all 50 of them.
    base = (make_rand(4096, seed=5) + 4.0).to(torch.bfloat16)
    moved = {}
    for master in (True, False):
        p = base.clone().requires_grad_()
        opt = FusedAdamW([p], lr=1e-4, weight_decay=0.0, master_weights=master)
        for _ in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        kept = opt.state[p]["master_param"] if master else p.detach().float()
        moved[master] = (kept - base.float()).mean().item()
    assert moved[True] == pytest.approx(-50 * 1e-4, rel=0.05)
    assert moved[False] == 0.0


def test_state_dict_round_trip_keeps_fp32_states(backend, make_rand, tmp_path):
    steps = 3 if backend.interpreted else 10

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 3))
        model = model.to(device=backend.device, dtype=torch.bfloat16)
        return model, FusedAdamW(model.parameters(), lr=1e-2)

    def train(model, opt, n, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(device=p.device, dtype=p.dtype)
            opt.step()

    model_a, opt_a = make()
    train(model_a, opt_a, steps, 1)
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, tmp_path / "ckpt.pt")
    train(model_a, opt_a, steps, 2)

    model_b, opt_b = make()
    ckpt = torch.load(tmp_path / "ckpt.pt")
    model_b.load_state_dict(ckpt["model"])
    opt_b.load_state_dict(ckpt["opt"])
    for p in model_b.parameters():
        assert opt_b.state[p]["exp_avg"].dtype == torch.float32
        assert opt_b.state[p]["master_param"].dtype == torch.float32
    train(model_b, opt_b, steps, 2)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(pb, pa, atol=0, rtol=0)
        torch.testing.assert_close(opt_b.state[pb]["master_param"], opt_a.state[pa]["master_param"], atol=0, rtol=0)


def test_amsgrad_names_the_alternative():
    with pytest.raises(NotImplementedError, match="torch.optim.AdamW"):
        FusedAdamW([torch.zeros(2, requires_grad=True)], amsgrad=True)


def test_params_without_grad_are_skipped(make_rand):
    a, b = make_rand(5).requires_grad_(), make_rand(6, seed=1).requires_grad_()
    opt = FusedAdamW([a, b])
    a.grad = torch.ones_like(a)
    before = b.detach().clone()
    opt.step()
    assert b not in opt.state and torch.equal(b.detach(), before)


class _CountLaunches:
    """Stands in for a Triton kernel object and counts its launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


_TRITON_DEVICES = [pytest.param("cpu", id="triton-cpu"),
                   pytest.param("cuda", id="triton-cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="no CUDA GPU here"))]


@pytest.mark.parametrize("device", _TRITON_DEVICES)
def test_triton_multi_tensor_group_matches_torch_adamw(device, monkeypatch):
    # One param group of five sizes and three dtypes, one of them a view at an odd (unaligned) offset; a 256-element
    # tile, so tensors span several tiles with a ragged last one; the 257-element param gets no gradient in the
    # first step, so steps 2-3 mix two step counts (per-tensor bias corrections) in one launch.
    if not triton_runnable(device):
        pytest.skip(f"Triton does not run on {device} tensors here (CPU: TRITON_INTERPRET=1)")
    from shardkit.kernels import adamw as triton_adamw

    counter = _CountLaunches(triton_adamw._adamw_multi_kernel)
    monkeypatch.setattr(triton_adamw, "_adamw_multi_kernel", counter)
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(700, generator=gen).to(device)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    base = [flat[1:600]] + [torch.randn(n, generator=gen).to(device) for n in (257, 1025, 40, 3)]
    mine = [b.detach().to(dt).requires_grad_() if dt != torch.float32 else b.detach().requires_grad_()
            for b, dt in zip(base, dtypes)]
    assert mine[0].data_ptr() % 16 != 0
    ref = [p.detach().float().clone().requires_grad_() for p in mine]
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, maximize=True)
    o_mine, o_ref = FusedAdamW(mine, **kw), torch.optim.AdamW(ref, **kw)
    with force_backend("triton"), triton_adamw.LAUNCH.override(block=256):
        for step in range(4):
            for i, (m, r) in enumerate(zip(mine, ref)):
                g = torch.randn(m.shape, generator=gen).to(device, m.dtype) if step or i != 1 else None
                m.grad, r.grad = g, None if g is None else g.float()  # the fp32 run sees the rounded gradients
            if step == 3:  # an optimizer resumed from a saved state dict continues exactly
                buf = io.BytesIO()
                torch.save(o_mine.state_dict(), buf)
                resumed = [p.detach().clone().requires_grad_() for p in mine]
                for p, q in zip(resumed, mine):
                    p.grad = q.grad.clone()
                o_resumed = FusedAdamW(resumed, **kw)
                o_resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
                o_resumed.step()
            o_mine.step()
            o_ref.step()
            if step == 0:
                assert counter.launches == 3  # one per (param dtype, grad dtype) pair, not one per tensor
    for m, r in zip(mine, ref):
        state = o_mine.state[m]
        kept = state.get("master_param", m)
        assert kept.dtype == torch.float32
        torch.testing.assert_close(kept.detach(), r.detach(), atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(state["exp_avg"], o_ref.state[r]["exp_avg"], atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(state["exp_avg_sq"], o_ref.state[r]["exp_avg_sq"], atol=1e-8, rtol=1e-5)
        assert state["step"].item() == o_ref.state[r]["step"].item()
        torch.testing.assert_close(m.detach(), kept.detach().to(m.dtype), atol=0, rtol=0)  # rounded to nearest
    for p, q in zip(resumed, mine):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
        for key, value in o_resumed.state[p].items():
            torch.testing.assert_close(value, o_mine.state[q][key], atol=0, rtol=0)
