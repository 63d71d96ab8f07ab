"""Per-rank model-state memory of every strategy, and shardkit's step time over each engine driven directly.

    python benchmarks/strategies.py memory [--hidden 256 --layers 4]
    python benchmarks/strategies.py speed  [--rounds 5 --steps 5]

memory: bytes of parameters, gradients and optimizer state each rank holds (counted from the
tensors, not RSS: on CPU, RSS hides sharding unless MALLOC_MMAP_THRESHOLD_ is lowered), next to
the ZeRO paper's fp32-Adam formula with Ψ parameters on N ranks:
    replicated 16Ψ;  ZeRO-1 4Ψ+4Ψ+8Ψ/N;  ZeRO-2 4Ψ+12Ψ/N;  ZeRO-3 / FSDP full 16Ψ/N.
speed: alternating rounds (raw engine, shardkit, raw, shardkit, ...) in the same 2 processes for
torch DDP, torch FSDP2 (fully_shard) and deepspeed.initialize (ZeRO-2, the same engine config shardkit
builds); the figure is the ratio of median step times.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from _timing import ranks_timed

import shardkit
from shardkit import Runner
from shardkit.distributed.process_group import init_distributed
from shardkit.models import Llama, LlamaBlock, LlamaConfig
from shardkit.strategies import strategy_from_name

os.environ.setdefault("DS_ACCELERATOR", "cpu")

FORMULAS = {  # bytes per parameter on each rank, as a function of N ranks (fp32 Adam)
    "ddp": lambda n: 16.0,
    "zero1": lambda n: 4 + 4 + 8 / n,
    "zero2": lambda n: 4 + 12 / n,
    "zero3": lambda n: 16 / n,
    "fsdp": lambda n: 16 / n,
}
# DeepSpeed keeps a separate fp32 master partition even when training in fp32 (the paper counts the
# fp32 parameters once): 4Ψ/N more for its ZeRO stages.
ENGINE_EXTRA = {"zero1": lambda n: 4 / n, "zero2": lambda n: 4 / n, "zero3": lambda n: 4 / n}


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                       num_layers=args.layers, num_heads=max(1, args.hidden // 32), max_position=args.seq)


def _batch(args: argparse.Namespace) -> torch.Tensor:
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))


def memory_worker(name: str, args: argparse.Namespace) -> dict:
    runner = Runner(strategy_from_name(name), seed=0)
    model = Llama(_config(args))
    psi = sum(p.numel() for p in model.parameters())
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = _batch(args)
    runner.backward(model(ids, ids))
    runner.step()  # optimizer state now exists
    runner.backward(model(ids, ids))  # and gradients are held again, as mid-step
    counted = runner.strategy.model_state_bytes(model, optimizer)
    runner.teardown()
    return {"psi": psi, **counted}


def run_memory(args: argparse.Namespace) -> None:
    print(f"model-state bytes per rank, Llama hidden={args.hidden} layers={args.layers}, 2 ranks, fp32 AdamW")
    columns = ("params", "grads", "optim", "total", "formula")
    print(f"{'strategy':9s} " + " ".join(f"{c:>10s}" for c in columns) + f" {'ratio':>6s} {'+master':>8s}")
    for name in args.strategies:
        result = shardkit.launch(memory_worker, args=(name, args), num_processes=2)[0]
        total = result["params"] + result["grads"] + result["optimizer"]
        formula = FORMULAS[name](2) * result["psi"]
        with_master = formula + ENGINE_EXTRA.get(name, lambda n: 0.0)(2) * result["psi"]
        mb = 2**20
        print(f"{name:9s} {result['params'] / mb:9.2f}M {result['grads'] / mb:9.2f}M {result['optimizer'] / mb:9.2f}M "
              f"{total / mb:9.2f}M {formula / mb:9.2f}M {total / formula:6.3f} {total / with_master:8.3f}")


def _raw_ddp(config: LlamaConfig, ids: torch.Tensor):
    model = torch.nn.parallel.DistributedDataParallel(Llama(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _raw_fsdp(config: LlamaConfig, ids: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Llama(config)
    for module in model.modules():
        if isinstance(module, LlamaBlock):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _raw_deepspeed(config: LlamaConfig, ids: torch.Tensor, ds_config: dict):
    import deepspeed

    model = Llama(config)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=ds_config)

    def step():
        engine.backward(engine(ids, ids))
        engine.step()

    return step


def speed_worker(args: argparse.Namespace) -> dict:
    init_distributed("cpu")
    config, ids = _config(args), _batch(args)
    results = {}
    for name in args.strategies:
        runner = Runner(strategy_from_name(name), seed=0)
        model = Llama(config)
        model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def ours():
            runner.backward(model(ids, ids))
            runner.step()

        torch.manual_seed(0)
        if name == "ddp":
            raw = _raw_ddp(config, ids)
        elif name == "fsdp":
            raw = _raw_fsdp(config, ids)
        else:
            raw = _raw_deepspeed(config, ids, runner.strategy.deepspeed_config(runner.unwrap_model(model)))
        for step in (raw, ours):
            ranks_timed(step, 2)
        times = {"raw": [], "ours": []}
        for _ in range(args.rounds):
            times["raw"].append(ranks_timed(raw, args.steps))
            times["ours"].append(ranks_timed(ours, args.steps))
        results[name] = times
    return results


def run_speed(args: argparse.Namespace) -> None:
    results = shardkit.launch(speed_worker, args=(args,), num_processes=2)[0]
    print(f"step time, Llama hidden={args.hidden} layers={args.layers} seq={args.seq} batch={args.batch}/rank, "
          f"2 ranks (gloo, CPU), fp32, {args.rounds} rounds x {args.steps} steps, medians")
    for name, times in results.items():
        raw, ours = statistics.median(times["raw"]), statistics.median(times["ours"])
        print(f"{name:6s} raw {raw * 1e3:8.1f} ms   shardkit {ours * 1e3:8.1f} ms   "
              f"ratio {ours / raw:.3f}  (goal <= 1.03)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["memory", "speed"])
    parser.add_argument("--strategies", nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.mode == "memory":
        args.strategies = args.strategies or ["ddp", "zero1", "zero2", "zero3", "fsdp"]
        run_memory(args)
    else:
        args.strategies = args.strategies or ["ddp", "fsdp", "zero2"]
        run_speed(args)


if __name__ == "__main__":
    main()
