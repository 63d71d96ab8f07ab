"""Peak memory of one training step (forward + backward) with and without activation checkpointing, per strategy.

    python benchmarks/activation_checkpointing.py [--hidden 256 --layers 6 --seq 256 --batch 8]
    python benchmarks/activation_checkpointing.py --strategies ddp fsdp zero3

One launch of 2 ranks runs every strategy: shardkit's Llama, fp32, AdamW, ``Runner(activation_checkpointing=...)``
off and on (the repeated blocks, use_reentrant=False). After one warm-up step, the peak is what the forward and
backward of the next step add over what was live before them, on rank 0 and rank 1 (the larger is printed):
on CPU the process's peak RSS (``_timing.peak_memory``: VmHWM reset through /proc/self/clear_refs, glibc's mmap
threshold fixed at 1 MiB so freed activations leave the resident set), on CUDA ``max_memory_allocated``. The
saved column is what autograd kept for backward in the forward (a saved-tensor hook; checkpointing keeps only
the block inputs), the share of the peak that checkpointing can remove.
"""

from __future__ import annotations

import argparse
import os

import torch
from _timing import ensure_malloc_returns_memory, fmt_bytes, machine_description, peak_memory

import shardkit
from shardkit import Runner
from shardkit.models import Llama, LlamaConfig
from shardkit.strategies.registry import STRATEGIES

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ALL = ("single", "ddp", "fsdp", "tp", "zero1", "zero2", "zero3", "zero_infinity")


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                       num_layers=args.layers, num_heads=max(2, args.hidden // 32), max_position=args.seq)


def _strategy(name: str):
    # ZeRO-Infinity's default swap buffers hold 1e8 elements each (5 of them: 2 GB per rank); 1e6 fits this model.
    return STRATEGIES.build(name, **({"buffer_size": 1_000_000} if name == "zero_infinity" else {}))


def _measure(name: str, ac: bool, args: argparse.Namespace) -> dict:
    runner = Runner(_strategy(name), seed=0, activation_checkpointing=True if ac else None)
    with runner.init_module():
        model = Llama(_config(args))
    model, _ = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(runner.rank))
    ids = ids.to(runner.device)

    def step() -> None:
        runner.backward(model(ids, ids))

    step()
    runner.step()  # warm-up: optimizer state exists and gradients were freed (set_to_none) by the step
    saved = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        peak = peak_memory(step, runner.device)
    runner.step()
    return {"peak": peak, "saved": saved[0]}


def worker(names: list[str], args: argparse.Namespace) -> dict:
    return {name: {ac: _measure(name, ac, args) for ac in (False, True)} for name in names}


def main() -> None:
    ensure_malloc_returns_memory()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--strategies", nargs="+", default=list(ALL), choices=ALL)
    args = parser.parse_args()
    env = {"MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(1 << 20)),
           "SHARDKIT_NVME_PATH": os.environ.get("SHARDKIT_NVME_PATH", "/tmp/shardkit_ac_bench_nvme")}
    ranks = shardkit.launch(worker, args=(args.strategies, args), num_processes=2, env=env)
    print(f"peak memory of forward+backward, Llama hidden={args.hidden} layers={args.layers} seq={args.seq} "
          f"batch={args.batch} per rank, fp32, 2 ranks; {machine_description()}")
    print(f"{'strategy':14s} {'peak off':>12s} {'peak on':>12s} {'on/off':>7s} {'saved off':>11s} {'saved on':>11s}")
    for name in args.strategies:
        off = max(r[name][False]["peak"] or 0 for r in ranks)
        on = max(r[name][True]["peak"] or 0 for r in ranks)
        saved = [max(r[name][ac]["saved"] for r in ranks) for ac in (False, True)]
        print(f"{name:14s} {off:12d} {on:12d} {on / off if off else float('nan'):7.2f} {fmt_bytes(saved[0]):>11s} "
              f"{fmt_bytes(saved[1]):>11s}")


if __name__ == "__main__":
    main()
