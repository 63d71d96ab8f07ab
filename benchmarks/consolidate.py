"""Peak RSS and wall time: ``shardkit zero-to-fp32`` vs DeepSpeed's ``zero_to_fp32.py`` on the same checkpoints.

    python benchmarks/consolidate.py --workdir /tmp/consolidate_bench

Builds (once, kept in --workdir) a DeepSpeed ZeRO-2 and a ZeRO-3 checkpoint of a model with
``--layers`` x ``--hidden``^2 weights (default 16 x 4096^2 = 268M parameters, 1.07 GB of fp32 master
weights) trained in bf16 on 2 CPU ranks with SGD, then runs both converters on each, alternating,
each in a fresh process with ``MALLOC_MMAP_THRESHOLD_`` lowered so that freed memory leaves the
process and shows in RSS. Peak RSS is the child's ``ru_maxrss`` (``os.wait4``); both write
safetensors with the same ``--max-shard-size``. The outputs are checked equal at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import child_wall_and_peak  # noqa: E402

GB = 1e9


def _build(root: str, stage: int, layers: int, hidden: int) -> bool:
    """Rank worker: a bf16 ZeRO-``stage`` engine over ``layers`` square linears, saved once."""
    import deepspeed
    from torch import nn

    from shardkit.distributed.process_group import init_distributed

    init_distributed("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.save_checkpoint(root)
    return True


def _ensure_checkpoint(workdir: Path, stage: int, layers: int, hidden: int) -> Path:
    from shardkit.distributed.launcher import launch

    path = workdir / f"zero{stage}"
    if not (path / "latest").exists():
        launch(_build, args=(str(path), stage, layers, hidden), num_processes=2, timeout=1800,
               env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    return path


def _commands(ckpt: Path, out: Path, shard: str) -> dict[str, list[str]]:
    return {
        "shardkit": [sys.executable, "-m", "shardkit.checkpoint.zero_to_fp32", str(ckpt), str(out / "shardkit"),
                     "--max-shard-size", shard],
        "deepspeed": [sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out / "deepspeed"),
                      "--safe_serialization", "--max_shard_size", shard],
    }


def _same_outputs(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        idx = d / "model.safetensors.index.json"
        if idx.exists():
            return {k: d / f for k, f in json.loads(idx.read_text())["weight_map"].items()}
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return {k: d / "model.safetensors" for k in f.keys()}

    ia, ib = index(a), index(b)
    if set(ia) != set(ib):
        return False
    for k in ia:
        with safe_open(str(ia[k]), "pt") as fa, safe_open(str(ib[k]), "pt") as fb:
            if not torch.equal(fa.get_tensor(k), fb.get_tensor(k)):
                return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/consolidate_bench")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--mmap-threshold", default="65536", help="MALLOC_MMAP_THRESHOLD_ for both converters")
    args = p.parse_args()
    workdir = Path(args.workdir)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": args.mmap_threshold, "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu"}
    weights = args.layers * args.hidden**2 * 4
    print(f"model: {args.layers} x Linear({args.hidden}, {args.hidden}): {weights / GB:.2f} GB fp32; "
          f"max shard {args.max_shard_size}; MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}")
    baseline = child_wall_and_peak([sys.executable, "-c", "import torch, safetensors"], env)[1]
    print(f"(python + import torch, safetensors alone: peak RSS {baseline / GB:.2f} GB)")
    print(f"{'stage':<7}{'tool':<11}{'wall s':>8}{'peak RSS GB':>13}   largest output file GB")
    for stage in (2, 3):
        ckpt = _ensure_checkpoint(workdir, stage, args.layers, args.hidden)
        out = workdir / f"out{stage}"
        results: dict[str, list[tuple[float, float]]] = {"shardkit": [], "deepspeed": []}
        for _ in range(args.rounds):
            for tool, cmd in _commands(ckpt, out, args.max_shard_size).items():
                shutil.rmtree(out / tool, ignore_errors=True)  # DeepSpeed leaves older shards of another size
                results[tool].append(child_wall_and_peak(cmd, env))
        for tool, runs in results.items():
            largest = max(f.stat().st_size for f in (out / tool).glob("*.safetensors"))
            wall = min(w for w, _ in runs)
            peak = max(r for _, r in runs)
            print(f"ZeRO-{stage:<2}{tool:<11}{wall:8.1f}{peak / GB:13.2f}   {largest / GB:.2f}")
        sk, ds = results["shardkit"], results["deepspeed"]
        print(f"ZeRO-{stage}: shardkit/deepspeed peak RSS {max(r for _, r in sk) / max(r for _, r in ds):.2f}x, "
              f"wall {min(w for w, _ in sk) / min(w for w, _ in ds):.2f}x; outputs equal: "
              f"{_same_outputs(out / 'shardkit', out / 'deepspeed')}")


if __name__ == "__main__":
    main()
