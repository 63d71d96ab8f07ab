"""Standalone cross-entropy: peak memory of one forward+backward, ours vs torch eager, on CPU.

Run: ``.venv/bin/python benchmarks/cross_entropy_memory.py [--rows 4096 --vocab 32000]`` (about a minute; CPU).
Measured as ``benchmarks/kernels.py`` measures it (``_timing.peak_memory``: the resident-set high-water mark on
CPU, over what was live before the call), at the H200 run's (4096, 32000), in units of the logits' size:

- on leaf logits (what the per-op table of ``benchmarks/kernels.py`` feeds every contender): torch's
  ``F.cross_entropy`` on the fp32 upcast, and ours, which must not write over a tensor the caller holds;
- on lm_head's output (an intermediate: ``hidden @ weight.T``), ours with ``overwrite_logits=True``, which
  writes the gradient over the logits as Liger-Kernel does (Liger does not run on CPU).

On CPU our row pass is the PyTorch reference (the Triton row kernel is GPU-only here): it allocates a few
temporaries per 64 MiB chunk, which the Triton kernel does not.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import machine_description, peak_memory

from shardkit.ops import cross_entropy


def _leaf_peak(fn, logits: torch.Tensor, target: torch.Tensor) -> int | None:
    leaf = logits.detach().requires_grad_()

    def run():
        fn(leaf, target).backward()

    leaf.grad = None
    run()  # first-call buffers out of the window
    return peak_memory(run, "cpu", lambda: setattr(leaf, "grad", None))


def _lm_head_peak(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> int | None:
    """The logits are made by the setup (outside the window) and consumed by the loss."""
    held: list[torch.Tensor] = []

    def setup():
        hidden.grad = None
        held[:] = [hidden @ weight.T]

    def run():
        logits = held.pop()
        cross_entropy(logits, target, overwrite_logits=True).backward()

    setup()
    run()
    return peak_memory(run, "cpu", setup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args()
    n, v = args.rows, args.vocab
    print(f"{machine_description()}\n")
    print(f"| ({n}, {v}) | logits | torch eager, leaf | ours, leaf | ours, overwrite_logits on lm_head's output |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, v, (n,), generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(n, 32, generator=gen).to(dtype).requires_grad_()
        weight = (torch.randn(v, 32, generator=gen) / 4).to(dtype)
        logits = (hidden @ weight.T).detach()
        size = logits.numel() * logits.element_size()
        eager = _leaf_peak(lambda z, t: F.cross_entropy(z.float(), t), logits, target)
        ours = _leaf_peak(cross_entropy, logits, target)
        over = _lm_head_peak(hidden, weight, target)
        cells = [f"{p / size:.2f}x ({p / 2**20:.0f} MiB)" for p in (eager, ours, over)]
        print(f"| {str(dtype).removeprefix('torch.')} | {size / 2**20:.0f} MiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
