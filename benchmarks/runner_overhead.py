"""Step time of Runner+DDP over raw torch DDP: same model, same data, 2 processes, side by side.

    python benchmarks/runner_overhead.py [--rounds 7] [--steps 10] [--hidden 256] [--precision fp32]

Both loops live in the same processes and alternate in rounds (raw, ours, raw, ours, ...) so that
machine noise hits both alike; the figure is the ratio of the median per-step times.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from _timing import ranks_timed
from torch.nn.parallel import DistributedDataParallel

import shardkit
from shardkit import DDP, Runner
from shardkit.distributed.process_group import init_distributed
from shardkit.models import Llama, LlamaConfig
from shardkit.precision import precision_from_name


def bench(args: argparse.Namespace) -> dict:
    init_distributed("cpu")
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8, num_layers=4,
                         num_heads=args.hidden // 32, max_position=args.seq)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batch = torch.randint(0, 256, (args.batch, args.seq), generator=generator)

    torch.manual_seed(0)
    raw_model = DistributedDataParallel(Llama(config))
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=1e-4)
    raw_precision = precision_from_name(args.precision)

    def raw_step():
        with raw_precision.autocast(torch.device("cpu")):
            loss = raw_model(batch, batch)
        loss.backward()
        raw_opt.step()
        raw_opt.zero_grad(set_to_none=True)

    runner = Runner(DDP(), precision_from_name(args.precision), seed=0)
    model = Llama(config)
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def our_step():
        runner.backward(model(batch, batch))
        runner.step()

    for step in (raw_step, our_step):  # warm-up: allocator, autograd graph caches, DDP buckets
        ranks_timed(step, 3)
    raw, ours = [], []
    for _ in range(args.rounds):
        raw.append(ranks_timed(raw_step, args.steps))
        ours.append(ranks_timed(our_step, args.steps))
    runner.teardown()
    return {"raw": statistics.median(raw), "ours": statistics.median(ours), "raw_all": raw, "ours_all": ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    result = shardkit.launch(bench, args=(args,), num_processes=2)[0]
    print(f"model: Llama hidden={args.hidden} layers=4 seq={args.seq} batch={args.batch}/rank, "
          f"2 processes (gloo, CPU), {args.precision}, {args.rounds} rounds x {args.steps} steps")
    print(f"raw torch DDP   median step {result['raw'] * 1e3:8.2f} ms   rounds: "
          + " ".join(f"{t * 1e3:.1f}" for t in result["raw_all"]))
    print(f"Runner + DDP    median step {result['ours'] * 1e3:8.2f} ms   rounds: "
          + " ".join(f"{t * 1e3:.1f}" for t in result["ours_all"]))
    print(f"ratio Runner/raw: {result['ours'] / result['raw']:.3f}  (goal <= 1.02)")


if __name__ == "__main__":
    main()
