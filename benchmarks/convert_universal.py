"""Peak RSS and wall time: DeepSpeed's ``ds_to_universal`` vs shardkit's universal conversions, same checkpoint.

    python benchmarks/convert_universal.py --workdir /tmp/universal_bench [--layers 8 --hidden 1024] [--rounds 2]

Builds (once, kept in --workdir) a DeepSpeed ZeRO-2 checkpoint of ``--layers`` square linears of ``--hidden``
(default 8 x 1024^2 = 8.4M parameters, 34 MB of fp32 weights, plus Adam's two moments) after one AdamW step on 2
CPU ranks. Then, each in a fresh process with ``MALLOC_MMAP_THRESHOLD_`` lowered so that freed memory leaves the
process and shows in RSS, alternating over ``--rounds``:

* ``ds_to_universal``: DeepSpeed's converter, ZeRO checkpoint -> universal (one extract and one merge worker, so
  that its peak is one process's; its default 4 + 2 worker processes each hold their own share);
* ``universal_to_shardkit``: that universal checkpoint -> a shardkit checkpoint (what a shardkit run resumes);
* ``shardkit_to_universal``: that shardkit checkpoint -> a universal checkpoint again (what DeepSpeed resumes).

Peak RSS is the child's ``ru_maxrss`` (``os.wait4``); "over import" subtracts the peak of a process that only
imports the same modules. The round trip is checked equal to DeepSpeed's universal files at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import child_wall_and_peak  # noqa: E402

MB = 1 << 20


def _build(root: str, layers: int, hidden: int) -> bool:
    """Rank worker: an fp32 ZeRO-2 engine over ``layers`` square linears, one AdamW step, saved once."""
    import deepspeed
    from torch import nn

    from shardkit.distributed.process_group import init_distributed

    init_distributed("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    model.universal_checkpoint_info = {"universal_checkpoint_version": 0.4}
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    engine.backward(engine(torch.randn(1, hidden)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(root)
    return True


def _ensure_checkpoint(workdir: Path, layers: int, hidden: int) -> Path:
    from shardkit.distributed.launcher import launch

    path = workdir / f"zero2_{layers}x{hidden}"
    if not (path / "latest").exists():
        launch(_build, args=(str(path), layers, hidden), num_processes=2, timeout=1800,
               env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    return path / (path / "latest").read_text().strip()


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


_SK = "from shardkit.checkpoint.ds_universal import shardkit_to_universal, universal_to_shardkit"


def _jobs(tag: Path, out: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (command, the command importing what it imports)."""
    universal = out / "ds" / f"{tag.name}_universal"
    return {
        "ds_to_universal": ([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                             "--output_folder", str(universal), "--num_extract_workers", "1",
                             "--num_merge_workers", "1"],
                            _py("import deepspeed.checkpoint.ds_to_universal")),
        "universal_to_shardkit": (_py(f"{_SK}; universal_to_shardkit({str(universal)!r}, {str(out / 'sk')!r})"),
                                  _py(_SK)),
        "shardkit_to_universal": (_py(f"{_SK}; shardkit_to_universal({str(out / 'sk')!r}, "
                                      f"{str(out / 'back' / universal.name)!r})"), _py(_SK)),
    }


def _same(ds: Path, back: Path) -> bool:
    """Every parameter's fp32 weight and moments equal in DeepSpeed's universal output and shardkit's."""
    for d in (ds / "zero").iterdir():
        if not d.is_dir():
            continue
        for f in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
            a, b = (torch.load(p / d.name / f, weights_only=False) for p in (ds / "zero", back / "zero"))
            if not torch.equal(a["param"], b["param"]):
                return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/universal_bench")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tag = _ensure_checkpoint(workdir, args.layers, args.hidden)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}
    results: dict[str, list[tuple[float, float, float]]] = {}
    out = workdir / "out"
    for _ in range(args.rounds):
        shutil.rmtree(out, ignore_errors=True)
        for name, (cmd, imports) in _jobs(tag, out).items():
            wall, peak = child_wall_and_peak(cmd, env)
            _, base = child_wall_and_peak(imports, env)
            results.setdefault(name, []).append((wall, peak, base))
    universal = out / "ds" / f"{tag.name}_universal"
    weights = args.layers * args.hidden ** 2 * 4
    print(f"ZeRO-2 checkpoint of {args.layers} x {args.hidden}^2 fp32 weights ({weights / MB:.0f} MB; the largest "
          f"tensor {args.hidden ** 2 * 4 / MB:.0f} MB), 2 ranks, AdamW; least of {args.rounds} rounds per column")
    print(f"{'conversion':24} {'wall s':>8} {'peak RSS MB':>12} {'over import MB':>15}")
    for name, rows in results.items():
        wall, peak, base = (min(col) for col in zip(*rows))
        print(f"{name:24} {wall:8.2f} {peak / MB:12.0f} {(peak - base) / MB:15.0f}")
    print("round trip equal to DeepSpeed's universal files:", _same(universal, out / "back" / universal.name))


if __name__ == "__main__":
    main()
