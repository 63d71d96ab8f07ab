"""SwiGLU / GeGLU memory from the autograd graph: bytes saved for backward and bytes the backward allocates.

Run: ``TRITON_INTERPRET=1 .venv/bin/python benchmarks/glu_memory.py`` (a few seconds; CPU). Per element of the
(tokens, intermediate) activation, for shardkit (each backend on this machine, in-place backward as the MLP
modules run it), eager PyTorch (``act(gate) * up``, what HF modeling code runs) and, by its source,
Liger-Kernel's ``LigerSiLUMulFunction`` (``ctx.save_for_backward(a, b)``, gradients written over a and b).
Saved bytes are counted with ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages); "backward
allocates" is the size of the gradients handed to the projections that are not the activations' own buffers.

The second table is the peak of one forward+backward over what was live before it, measured as
``benchmarks/kernels.py`` measures it (``_timing.peak_memory``: the resident-set high-water mark on CPU), at the
H200 run's (4096, 11008) fp32, in units of one activation: on leaf inputs (what the per-op table of
``benchmarks/kernels.py`` feeds every contender) and as the MLP runs it (gate and up fresh outputs of two
linears, ``in_place_backward=True``, what ``apply_fused_kernels`` runs).
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _timing import peak_memory  # noqa: E402

from shardkit.ops import available_backends, force_backend, geglu, swiglu  # noqa: E402


def _measure(fn, m: int, f: int, dtype: torch.dtype) -> tuple[float, float]:
    x = torch.randn(m, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(2 * f, 16, dtype=dtype)
    gate, up = ((x @ w.T)[:, :f].contiguous(), (x @ w.T)[:, f:].contiguous())
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(gate, up)
    own = {gate.data_ptr(), up.data_ptr()}
    fresh: list[int] = []
    for t in (gate, up):
        t.register_hook(lambda g: fresh.append(0 if g.data_ptr() in own else g.numel() * g.element_size()))
    y.backward(torch.ones_like(y))
    elems = m * f
    return sum(storages.values()) / elems, sum(fresh) / elems


def main() -> None:
    m, f = 64, 11008  # a 7B Llama MLP's width; bytes per element do not depend on the row count
    ops = {"swiglu": (swiglu, F.silu), "geglu": (geglu, lambda t: F.gelu(t, approximate="tanh"))}
    print("| op | dtype | implementation | saved B/elem | backward allocates B/elem |\n|---|---|---|---|---|")
    for name, (fused, act) in ops.items():
        for dtype in (torch.float32, torch.bfloat16):
            size = dtype.itemsize
            rows = [("eager PyTorch", *_measure(lambda g, u: act(g) * u, m, f, dtype))]
            for backend in ("reference", "cpp", "triton"):
                if backend in available_backends("cpu"):
                    with force_backend(backend):
                        rows.append((f"shardkit {backend}",
                                     *_measure(lambda g, u: fused(g, u, in_place_backward=True), m, f, dtype)))
            rows.append(("Liger-Kernel (by its source)", 2 * size, 0))
            for impl, saved, alloc in rows:
                print(f"| {name} | {str(dtype).removeprefix('torch.')} | {impl} | {saved:g} | {alloc:g} |")


def _leaf_peak(fn, gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> int | None:
    leaves = [t.detach().requires_grad_() for t in (gate, up)]
    return peak_memory(lambda: fn(*leaves).backward(dy), "cpu", lambda: [setattr(t, "grad", None) for t in leaves])


def _mlp_peak(fn, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, dy: torch.Tensor) -> int | None:
    """gate/up made by the setup (outside the window), consumed by the op: the window sees the op alone."""
    held: list[torch.Tensor] = []

    def setup():
        x.grad = None
        held[:] = [x @ wg.T, x @ wu.T]

    def run():
        gate, up = held
        held.clear()
        fn(gate, up).backward(dy)

    setup()
    run()  # first-call buffers out of the window
    return peak_memory(run, "cpu", setup)


def peaks(m: int = 4096, f: int = 11008) -> None:
    """CPU peaks of forward+backward in units of one (m, f) fp32 activation (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, 16, generator=gen).requires_grad_()
    wg, wu = torch.randn(f, 16, generator=gen), torch.randn(f, 16, generator=gen)
    dy = torch.randn(m, f, generator=gen)
    gate, up = (x @ wg.T).detach(), (x @ wu.T).detach()
    act_bytes = m * f * 4
    print(f"\n| op ({m}, {f}) fp32 | implementation | peak on leaf inputs | peak in an MLP |\n|---|---|---|---|")
    ops = {"swiglu": (swiglu, F.silu), "geglu": (geglu, lambda t: F.gelu(t, approximate="tanh"))}
    for name, (fused, act) in ops.items():
        rows = [("eager PyTorch", lambda g, u, act=act: act(g) * u, None)]
        rows += [(f"shardkit {b}", fused, b) for b in ("reference", "cpp") if b in available_backends("cpu")]
        for impl, fn, backend in rows:
            inplace = (lambda g, u, fn=fn: fn(g, u, in_place_backward=True)) if backend else fn
            with force_backend(backend) if backend else contextlib.nullcontext():
                leaf = _leaf_peak(fn, gate, up, dy)
                mlp = _mlp_peak(inplace, x, wg, wu, dy)
            print(f"| {name} | {impl} | {leaf / act_bytes:.2f}x | {mlp / act_bytes:.2f}x |")


if __name__ == "__main__":
    main()
    peaks()
