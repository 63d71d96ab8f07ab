"""GPU check (issue 28 item 3): the multi-tensor Triton AdamW at a model's size equals torch's fused AdamW.

The kernel tests run it on a few tiny tensors; this runs FusedAdamW on the Triton backend over 110M fp32
parameters in 111 Llama-shaped tensors (full tiles, 128-bit accesses, a ~54K-program grid) and over the same model
in bf16 with fp32 masters, 3 steps each, beside ``torch.optim.AdamW(fused=True)`` on fp32 copies fed the same
gradients, and counts the kernel's launches (one per step and dtype pair, not one per tensor). Prints one PASS/FAIL
line per check; exit status 0 only when all pass. About 10 s on a recent GPU.

    python scripts/gpu_checks/adamw_multi_tensor.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _model_shapes import llama_like_sizes  # noqa: E402

from shardkit.kernels import adamw as triton_adamw  # noqa: E402
from shardkit.ops import force_backend  # noqa: E402
from shardkit.optim import FusedAdamW  # noqa: E402

STEPS = 3


def run(dtype: torch.dtype) -> list[tuple[str, bool, str]]:
    """One comparison at ``dtype``: (check name, passed, detail) per check."""
    sizes = llama_like_sizes(768, 2048, 16_000, 12)
    gen = torch.Generator(device="cuda").manual_seed(0)
    mine = [torch.randn(n, generator=gen, device="cuda").to(dtype).requires_grad_() for n in sizes]
    ref = [p.detach().float().clone().requires_grad_() for p in mine]
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    o_mine, o_ref = FusedAdamW(mine, **kw), torch.optim.AdamW(ref, fused=True, **kw)
    launches = 0
    kernel = triton_adamw._adamw_multi_kernel

    class Count:
        def __getitem__(self, grid):
            nonlocal launches
            launches += 1
            return kernel[grid]

    triton_adamw._adamw_multi_kernel = Count()
    try:
        with force_backend("triton"):
            for _ in range(STEPS):
                for m, r in zip(mine, ref):
                    g = torch.randn(m.shape, generator=gen, device="cuda").to(dtype) * 1e-2
                    m.grad, r.grad = g, g.float()
                o_mine.step()
                o_ref.step()
    finally:
        triton_adamw._adamw_multi_kernel = kernel
    torch.cuda.synchronize()
    worst = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for m, r in zip(mine, ref):
        state = o_mine.state[m]
        pairs = {"param": (state.get("master_param", m), r), "exp_avg": (state["exp_avg"], o_ref.state[r]["exp_avg"]),
                 "exp_avg_sq": (state["exp_avg_sq"], o_ref.state[r]["exp_avg_sq"])}
        for key, (a, b) in pairs.items():  # error relative to atol + rtol |b|, as torch.testing does
            tol = {"param": 2e-6, "exp_avg": 1e-8, "exp_avg_sq": 1e-10}[key] + 1e-5 * b.detach().abs()
            worst[key] = max(worst[key], ((a.detach() - b.detach()).abs() / tol).max().item())
    label = f"{sum(sizes) / 1e6:.0f}M params in {len(sizes)} tensors, {str(dtype).removeprefix('torch.')}"
    out = [(f"{label}: {key} vs torch fused", err <= 1.0, f"max err/tol {err:.3g}") for key, err in worst.items()]
    out.append((f"{label}: one launch per step", launches == STEPS, f"{launches} launches in {STEPS} steps"))
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("FAIL cuda: no CUDA device")
        return 1
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        try:
            checks = run(dtype)
        except Exception as err:  # noqa: BLE001 - reported as a FAIL line
            checks = [(f"adamw {dtype}", False, f"{type(err).__name__}: {str(err)[:300]}")]
        for name, ok, detail in checks:
            print(f"{'PASS' if ok else 'FAIL'} {name} ({detail})", flush=True)
            results.append(ok)
        torch.cuda.empty_cache()
    print("PASS all" if all(results) else "FAIL some checks", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
