"""Estimated vs measured per-rank model-state bytes for every strategy on 2 CPU ranks.

    python benchmarks/estimate.py [--hidden 256 --layers 4 --precision fp32]

Each strategy sets up shardkit's Llama with AdamW on 2 ranks, takes one step and a second backward (so
optimizer state and gradients are both held), and reports the strategy's own ``model_state_bytes``;
``shardkit.memory.estimate_model_states`` predicts the same from the model's config (device plus host
bytes: ``model_state_bytes`` counts offloaded states too; states swapped to NVMe are neither held nor
counted). The figure is estimated / measured per strategy (goal: within 5%).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import shardkit
from shardkit import Runner
from shardkit.memory import LAYOUTS, estimate_model_states, find_layout, spec_from_llama_config
from shardkit.models import Llama, LlamaConfig
from shardkit.precision import precision_from_name

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Every row the estimator knows, built as the estimator describes it (shardkit.memory.LAYOUTS).
CASES = [layout.name for layout in LAYOUTS]


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                       num_layers=args.layers, num_heads=max(1, args.hidden // 32), max_position=args.seq)


def measure(name: str, args: argparse.Namespace) -> dict:
    """Rank worker: the strategy's model_state_bytes after a step and a second backward."""
    layout = find_layout(name)
    kwargs = {"nvme_path": tempfile.mkdtemp(prefix="sk_nvme_")} if layout.strategy == "zero_infinity" else {}
    runner = Runner(layout.build(**kwargs), precision=precision_from_name(args.precision), seed=0)
    model = Llama(_config(args))
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(runner.rank)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    runner.backward(model(ids, ids))
    runner.step()
    runner.backward(model(ids, ids))
    counted = runner.strategy.model_state_bytes(model, optimizer)
    runner.teardown()
    return {k: int(v) for k, v in counted.items() if k in ("params", "grads", "optimizer")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--strategies", nargs="+", default=list(CASES))
    args = p.parse_args()
    spec = spec_from_llama_config(_config(args))
    mib = 2**20
    print(f"Llama hidden={args.hidden} layers={args.layers} ({spec.total_params / 1e6:.2f}M params), 2 CPU ranks, "
          f"{args.precision}, AdamW; MiB per rank (params + grads + optimizer)")
    print(f"{'strategy':<16}{'measured':>10}{'estimated':>11}{'ratio':>8}   measured p/g/o")
    for name in args.strategies:
        try:
            got = shardkit.launch(measure, args=(name, args), num_processes=2,
                                  env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})[0]
        except Exception as e:  # one strategy that cannot run here (e.g. no libaio for NVMe) must not hide the rest
            print(f"{name:<16} could not run: {str(e).strip().splitlines()[-1][:100]}")
            continue
        est = estimate_model_states(spec, name, num_gpus_per_node=2, precision=args.precision,
                                    reduce_bucket_size=args.hidden**2)
        measured = sum(got.values())
        total = est.device_total + est.host  # model_state_bytes counts host-offloaded states too
        print(f"{name:<16}{measured / mib:10.2f}{total / mib:11.2f}{total / measured:8.3f}   "
              f"{got['params'] / mib:.2f}/{got['grads'] / mib:.2f}/{got['optimizer'] / mib:.2f}")


if __name__ == "__main__":
    main()
