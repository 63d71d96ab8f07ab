"""SwiGLU and GeGLU: every backend present vs the float64 reference, forward and backward, out of place and in
place; the bytes the autograd graph saves, against Liger-Kernel's and eager PyTorch's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fresh_process import in_fresh_process

from benchmarks._timing import peak_memory
from shardkit.nn import GeGLUMLP, SwiGLUMLP
from shardkit.ops import geglu, geglu_reference, swiglu, swiglu_reference

SHAPES = [(7,), (3, 5, 37), (5, 123, 123), (2, 4100)]
OPS = {"swiglu": (swiglu, swiglu_reference), "geglu": (geglu, geglu_reference)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(fn, g, u, dy):
    g = g.detach().clone().requires_grad_()
    u = u.detach().clone().requires_grad_()
    y = fn(g, u)
    y.backward(dy)
    return y.detach(), g.grad, u.grad


def _grads_in_place(fn, g, u, dy):
    """Gate and up as non-leaf activations (as in an MLP): the backward may write over them."""
    g0 = g.detach().clone().requires_grad_()
    u0 = u.detach().clone().requires_grad_()
    g1, u1 = g0 * 1, u0 * 1  # fresh non-leaf buffers
    ptrs = (g1.data_ptr(), u1.data_ptr())
    y = fn(g1, u1, in_place_backward=True)
    y.backward(dy)
    return (y.detach(), g0.grad, u0.grad), ptrs, (g1.detach(), u1.detach())


def _inputs(shape, dtype, device, make_rand):
    g = make_rand(*shape, dtype=dtype, device=device, seed=1, scale=3.0)  # both tails of the sigmoid
    u = make_rand(*shape, dtype=dtype, device=device, seed=2)
    dy = make_rand(*shape, dtype=dtype, device=device, seed=3)
    return g, u, dy


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_fp64_reference(backend, op, shape, dtype, make_rand, check_close):
    if backend.interpreted and shape == (5, 123, 123) and dtype == torch.float16:
        pytest.skip("interpreter: fp32 and bf16 cover this shape")
    fn, ref_fn = OPS[op]
    g, u, dy = _inputs(shape, dtype, backend.device, make_rand)
    lowp = _grads(ref_fn, g, u, dy)
    ref = _grads(ref_fn, g.double(), u.double(), dy.double())
    out = _grads(fn, g, u, dy)
    in_place, ptrs, overwritten = _grads_in_place(fn, g, u, dy)
    for name, got, got_ip, low, exact in zip(("y", "dgate", "dup"), out, in_place, lowp, ref):
        check_close(got, low, exact, name=name)
        check_close(got_ip, low, exact, name=f"{name} (in place)")
    # the gradients were written over the two activations: gate now holds d gate, up holds d up
    torch.testing.assert_close(overwritten[0], in_place[1], rtol=0, atol=0)
    torch.testing.assert_close(overwritten[1], in_place[2], rtol=0, atol=0)


class _SavedBytes:
    """Counts the bytes the autograd graph saves (distinct storages) while active."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_saved_bytes_equal_liger_and_backward_allocates_nothing(backend, op, dtype):
    """Saved: gate and up only, 2 x element size per element, what Liger's LigerSiLUMulFunction saves (its
    ctx.save_for_backward(a, b)); eager PyTorch's ``act(g) * u`` saves 3 (g, act(g), u). In place, the gradients
    the backward hands to the projections are the activations' own buffers: no (tokens, intermediate) tensor."""
    fn, _ = OPS[op]
    m, f = 4, 96
    x = torch.randn(m, 8, device=backend.device, dtype=dtype, requires_grad=True)
    w = torch.randn(2 * f, 8, device=backend.device, dtype=dtype)
    gate, up = (x @ w.T).split(f, dim=1)
    gate, up = gate.contiguous(), up.contiguous()
    with _SavedBytes() as ours:
        y = fn(gate, up, in_place_backward=True)
    with _SavedBytes() as eager:
        act = F.silu(gate) if op == "swiglu" else F.gelu(gate, approximate="tanh")
        act * up
    per_elem = dtype.itemsize
    assert ours.nbytes == 2 * per_elem * m * f  # Liger: a and b
    assert eager.nbytes == 3 * per_elem * m * f
    seen = {}
    gate.register_hook(lambda g: seen.__setitem__("gate", g.data_ptr()))
    up.register_hook(lambda g: seen.__setitem__("up", g.data_ptr()))
    ptrs = {"gate": gate.data_ptr(), "up": up.data_ptr()}
    y.backward(torch.ones_like(y))
    assert seen == ptrs


def test_in_place_is_refused_where_it_would_destroy_a_tensor_someone_holds():
    """Leaves (a user's tensors, parameters) and overlapping/strided views get the out-of-place backward."""
    leaf_g, leaf_u = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16, requires_grad=True)
    before = leaf_g.detach().clone()
    swiglu(leaf_g, leaf_u, in_place_backward=True).sum().backward()
    torch.testing.assert_close(leaf_g.detach(), before)
    fused = torch.randn(3, 32, requires_grad=True) * 1
    gate, up = fused.chunk(2, dim=-1)  # strided views of one buffer (Phi-3's layout)
    kept = fused.detach().clone()
    swiglu(gate, up, in_place_backward=True).sum().backward()
    torch.testing.assert_close(fused.detach(), kept)


def test_in_place_second_backward_raises():
    g = torch.randn(4, 16, requires_grad=True) * 1
    u = torch.randn(4, 16, requires_grad=True) * 1
    y = swiglu(g, u, in_place_backward=True).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("cls,act", [(SwiGLUMLP, F.silu), (GeGLUMLP, lambda t: F.gelu(t, approximate="tanh"))])
def test_mlp_modules_match_eager(cls, act):
    torch.manual_seed(0)
    mlp = cls(16, 40)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = mlp(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    mlp.zero_grad()
    x.grad = None
    y_ref = mlp.down_proj(act(mlp.gate_proj(x)) * mlp.up_proj(x))
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref)
    for got, want in zip(grads, [p.grad for p in mlp.parameters()] + [x.grad]):
        torch.testing.assert_close(got, want)


def test_in_place_is_refused_on_a_view_of_a_leaf():
    """``leaf.view(...)`` has a grad_fn but shares the leaf's storage: writing gradients over it would destroy
    the user's tensor (it did before can_overwrite checked the base)."""
    leaf_g, leaf_u = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16, requires_grad=True)
    kept = leaf_g.detach().clone(), leaf_u.detach().clone()
    geglu(leaf_g.view(48), leaf_u.view(48), in_place_backward=True).sum().backward()
    torch.testing.assert_close((leaf_g.detach(), leaf_u.detach()), kept, rtol=0, atol=0)


def mlp_peaks(op: str) -> tuple[float, float]:
    """CPU peak of forward+backward in units of one activation: in an MLP (in-place backward), on leaf inputs."""
    fn, _ = OPS[op]
    m, f = 1024, 11008  # 43 MiB per activation: each its own mmap, counted once by the RSS high-water mark
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, 8, generator=gen).requires_grad_()
    wg, wu = torch.randn(f, 8, generator=gen), torch.randn(f, 8, generator=gen)
    dy = torch.randn(m, f, generator=gen)
    held: list[torch.Tensor] = []

    def setup():
        x.grad = None
        held[:] = [x @ wg.T, x @ wu.T]

    def run(**kw):
        gate, up = held
        held.clear()
        fn(gate, up, **kw).backward(dy)

    setup()
    run(in_place_backward=True)
    in_mlp = peak_memory(lambda: run(in_place_backward=True), "cpu", setup) / (m * f * 4)
    leaves = [t.detach().requires_grad_() for t in (x @ wg.T, x @ wu.T)]
    on_leaves = peak_memory(lambda: fn(*leaves).backward(dy), "cpu",
                            lambda: [setattr(t, "grad", None) for t in leaves]) / (m * f * 4)
    return in_mlp, on_leaves


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resident-set accounting")
@pytest.mark.parametrize("op", OPS)
def test_cpu_peak_in_an_mlp_is_the_output_alone(op):
    """The path apply_fused_kernels runs (gate and up from linears, in_place_backward=True): forward+backward
    adds the output alone (1x the activation, as Liger); on leaf inputs (what benchmarks/kernels.py measured on
    the H200) the backward allocates both gradients (3x): the inputs are the user's and are never overwritten."""
    in_mlp, on_leaves = in_fresh_process("test_swiglu", "mlp_peaks", op)  # see fresh_process.py
    assert in_mlp < 1.3, in_mlp
    assert 2.7 < on_leaves < 3.3, on_leaves


def benchmark_mlp_peaks() -> dict[str, list[float]]:
    """Per op, [eager, ours] peaks of benchmarks/kernels.py's MLP harness (``_FreshGluInputs``), in activations."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("benchmark_kernels", path)
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(bench)  # no re-exec: the fresh process has glibc's mmap threshold set already
    m, f = 1024, 11008
    dy = torch.randn(m, f, generator=torch.Generator().manual_seed(0))
    out = {}
    for op, (fn, _) in OPS.items():
        peaks = []
        for run in (bench._EAGER[op], lambda g, u, fn=fn: fn(g, u, in_place_backward=True)):
            case = bench._FreshGluInputs(run, m, f, torch.float32, "cpu", dy)
            case.setup()
            case.run()  # first-call buffers out of the window
            peaks.append(peak_memory(case.run, "cpu", case.setup) / (m * f * 4))
        out[op] = peaks
    return out


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resident-set accounting")
def test_kernel_benchmark_measures_glu_as_an_mlp_runs_it():
    """benchmarks/kernels.py's GLU table feeds fresh linear outputs (not leaves): there ours writes its gradients
    in place and peaks at the output alone (Liger's 1x), eager at output + 3 gradient-sized buffers (4x)."""
    for op, (eager, ours) in in_fresh_process("test_swiglu", "benchmark_mlp_peaks").items():
        assert ours < 1.3, (op, ours)
        assert 3.7 < eager < 4.3, (op, eager)
