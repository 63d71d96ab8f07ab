"""SwiGLU / GeGLU memory from the autograd graph: bytes saved for backward and bytes the backward allocates.

Run: ``TRITON_INTERPRET=1 .venv/bin/python benchmarks/glu_memory.py`` (a few seconds; CPU). Per element of the
(tokens, intermediate) activation, for shardkit (each backend on this machine, in-place backward as the MLP
modules run it), eager PyTorch (``act(gate) * up``, what HF modeling code runs) and, by its source,
Liger-Kernel's ``LigerSiLUMulFunction`` (``ctx.save_for_backward(a, b)``, gradients written over a and b).
Saved bytes are counted with ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages); "backward
allocates" is the size of the gradients handed to the projections that are not the activations' own buffers.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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


if __name__ == "__main__":
    main()
