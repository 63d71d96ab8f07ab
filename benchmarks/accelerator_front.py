"""Step time through shardkit.Accelerator against the Runner directly (and Hugging Face Accelerate itself).

    python benchmarks/accelerator_front.py [--rounds 9] [--steps 3] [--hidden 256] [--accumulation 2]

1. Same model (shardkit's Llama), data and AdamW in the same 2 processes (gloo, CPU, DDP); the loops alternate
   round by round, each round in a rotated order (runner, front, accelerate; then front, accelerate, runner; ...)
   so that machine noise and position hit them alike. Each timed step is one optimizer step: ``--accumulation``
   micro-batches, through ``runner.backward``/``runner.step``, through the front's ``accumulate(model)``/
   ``backward``/``optimizer.step()``/``zero_grad()``, and through ``accelerate.Accelerator`` the same way. The
   front only translates to the Runner, so its ratio to the Runner is expected to be 1.0 within noise. Both
   Accelerators get ``cpu=True`` and must come back with a DDP model (the script stops otherwise): without it
   Hugging Face Accelerate trained each process alone on a GPU-less machine (see benchmarks/RESULTS.md).
2. The front's own cost, where nothing else hides it: one process, a 2-layer MLP of 8 units, the same two loops,
   microseconds per optimizer step.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from _timing import ranks_timed

import shardkit
from shardkit import DDP, Accelerator, Runner
from shardkit.models import Llama, LlamaConfig


def _model(args: argparse.Namespace) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8, num_layers=4,
                             num_heads=args.hidden // 32, max_position=args.seq))


def _batches(args: argparse.Namespace) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randint(0, 256, (args.batch, args.seq), generator=generator) for _ in range(args.accumulation)]


def runner_step(args: argparse.Namespace):
    runner = Runner(DDP(), gradient_accumulation_steps=args.accumulation, seed=0)
    model = _model(args)
    model, _ = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batches = _batches(args)

    def step():
        for batch in batches:
            runner.backward(model(batch, batch))
        runner.step()

    return step


def front_step(args: argparse.Namespace, accelerator_class=Accelerator):
    # cpu=True: on a machine without a GPU, Hugging Face Accelerate only sees the 2 processes (MULTI_CPU, a DDP
    # model) when told to run on the CPU (what `accelerate launch --cpu` sets); without it, it trains each process
    # alone (DistributedType.NO: no DDP wrapper, no gradient all-reduce) and its step looked 5% faster than a
    # real DDP step. Both fronts get the same argument.
    accelerator = accelerator_class(gradient_accumulation_steps=args.accumulation, cpu=True)
    model = _model(args)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(f"{accelerator_class.__module__}.Accelerator prepared a {type(model).__name__}, not a DDP "
                           f"model (distributed_type {accelerator.distributed_type}): the loops would not do the same "
                           f"work")
    batches = _batches(args)

    def step():
        for batch in batches:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch, batch))
                optimizer.step()
                optimizer.zero_grad()

    return step


def accelerate_step(args: argparse.Namespace):
    """The same loop on Hugging Face Accelerate (it joins the process group shardkit made)."""
    from accelerate import Accelerator as HFAccelerator

    return front_step(args, HFAccelerator)


def bench(args: argparse.Namespace) -> dict:
    shardkit.distributed.init_distributed("cpu")
    contenders = {"runner": runner_step(args), "front": front_step(args)}
    if not args.no_accelerate:
        contenders["accelerate"] = accelerate_step(args)
    for step in contenders.values():  # warm-up: allocator, autograd graph caches, DDP buckets
        ranks_timed(step, 2)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            times[name].append(ranks_timed(contenders[name], args.steps))
    return times


def python_cost(rounds: int = 20, steps: int = 200) -> dict[str, float]:
    """Seconds per optimizer step (2 micro-batches) of the two loops on a tiny model in this process."""
    import time

    from torch import nn

    def tiny():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    x = torch.randn(4, 8)
    runner = Runner(gradient_accumulation_steps=2)
    model = tiny()
    plain, _ = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = tiny()
    front, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))

    def runner_loop():
        for _ in range(2):
            runner.backward(plain(x).sum())
        runner.step()

    def front_loop():
        for _ in range(2):
            with accelerator.accumulate(front):
                accelerator.backward(front(x).sum())
                optimizer.step()
                optimizer.zero_grad()

    times: dict[str, list[float]] = {"runner": [], "front": []}
    for _ in range(rounds):
        for name, loop in (("runner", runner_loop), ("front", front_loop)):
            start = time.perf_counter()
            for _ in range(steps):
                loop()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--no-accelerate", action="store_true", help="leave Hugging Face Accelerate out")
    args = parser.parse_args()
    times = shardkit.launch(bench, args=(args,), num_processes=2)[0]
    print(f"model: Llama hidden={args.hidden} layers=4 seq={args.seq} batch={args.batch}/rank x {args.accumulation} "
          f"micro-batches per step, 2 processes (gloo, CPU, DDP), fp32, {args.rounds} rounds x {args.steps} steps")
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:<11} median step {median[name] * 1e3:8.2f} ms   rounds: "
              + " ".join(f"{t * 1e3:.1f}" for t in values))
    print(f"ratio front/runner: {median['front'] / median['runner']:.3f}  (expected 1.0 within noise)")
    if "accelerate" in median:
        print(f"ratio front/accelerate: {median['front'] / median['accelerate']:.3f}")
    torch.set_num_threads(1)
    cost = python_cost()
    print(f"tiny MLP, one process, per optimizer step of 2 micro-batches: runner {cost['runner'] * 1e6:.0f} us, "
          f"front {cost['front'] * 1e6:.0f} us (the front's own cost: {(cost['front'] - cost['runner']) * 1e6:.0f} "
          f"us a step)")


if __name__ == "__main__":
    main()
