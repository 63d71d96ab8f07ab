"""Peak RSS and wall time: ``shardkit convert`` of a DCP checkpoint vs torch's own ``dcp_to_torch_save``.

    python benchmarks/convert.py --workdir /tmp/convert_bench

Builds (once, kept in --workdir) a torch.distributed.checkpoint directory with ``dcp.save`` of a model of
``--layers`` x Linear(``--hidden``, ``--hidden``) and its AdamW state after one step (weights, exp_avg and
exp_avg_sq: 3 x layers x hidden^2 fp32 values), then converts it, each tool in a fresh process with
``MALLOC_MMAP_THRESHOLD_`` lowered so that freed memory leaves the process and shows in RSS:

* ``dcp_to_torch_save``: torch's converter (every tensor into one ``torch.save`` file);
* ``shardkit --to shardkit``: the same tensors (model and optimizer) into a shardkit checkpoint;
* ``shardkit --to hf``: the model's weights only, as zero-to-fp32 writes them.

Peak RSS is the child's ``ru_maxrss`` (``os.wait4``). The shardkit checkpoint is checked equal to torch's file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import child_wall_and_peak  # noqa: E402

GB = 1e9


def _ensure_checkpoint(workdir: Path, layers: int, hidden: int) -> Path:
    """Built in a child process: a child's ``ru_maxrss`` starts from its parent's peak at fork (Linux keeps it
    across exec), so the parent never holds the model."""
    path = workdir / f"dcp_{layers}x{hidden}"
    if not (path / ".metadata").exists():
        subprocess.run([sys.executable, __file__, "--build-into", str(path), "--layers", str(layers), "--hidden",
                        str(hidden)], check=True)
    return path


def _build(path: Path, layers: int, hidden: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, hidden)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(path))


def _commands(ckpt: Path, out: Path) -> dict[str, list[str]]:
    torch_save = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                  "dcp_to_torch_save(sys.argv[1], sys.argv[2])")
    convert = [sys.executable, "-m", "shardkit.checkpoint.convert", str(ckpt)]
    return {"dcp_to_torch_save": [sys.executable, "-c", torch_save, str(ckpt), str(out / "torch.pt")],
            "shardkit --to shardkit": [*convert, str(out / "shardkit"), "--to", "shardkit"],
            "shardkit --to hf": [*convert, str(out / "hf"), "--to", "hf"]}


def _same(out: Path) -> bool:
    from shardkit.checkpoint import CheckpointReader

    whole = torch.load(out / "torch.pt", weights_only=True)
    reader = CheckpointReader(out / "shardkit")
    for fqn, t in whole["model"].items():
        if not torch.equal(reader.read_full("model", fqn), t):
            return False
    for fqn, st in whole["optimizer"]["state"].items():
        for k, v in st.items():
            if v.dim() and not torch.equal(reader.read_full("optimizer", f"{fqn}/{k}"), v):
                return False
    return True


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/convert_bench")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mmap-threshold", default="65536", help="MALLOC_MMAP_THRESHOLD_ for every tool")
    p.add_argument("--build-into", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.build_into:
        _build(Path(args.build_into), args.layers, args.hidden)
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": args.mmap_threshold, "OMP_NUM_THREADS": "1"}
    ckpt = _ensure_checkpoint(workdir, args.layers, args.hidden)
    print(f"DCP checkpoint: {args.layers} x Linear({args.hidden}, {args.hidden}) + AdamW state: "
          f"{_size(ckpt) / GB:.2f} GB; largest tensor {args.hidden ** 2 * 4 / GB:.3f} GB")
    imports = "import torch, torch.distributed.checkpoint, safetensors"
    baseline = child_wall_and_peak([sys.executable, "-c", imports], env)[1]
    print(f"(python + import torch, torch.distributed.checkpoint, safetensors alone: peak RSS {baseline / GB:.2f} GB)")
    out = workdir / "out"
    outputs = {"dcp_to_torch_save": out / "torch.pt", "shardkit --to shardkit": out / "shardkit",
               "shardkit --to hf": out / "hf"}
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for tool, cmd in _commands(ckpt, out).items():
            shutil.rmtree(outputs[tool], ignore_errors=True)
            outputs[tool].unlink(missing_ok=True) if outputs[tool].is_file() else None
            out.mkdir(exist_ok=True)
            runs.setdefault(tool, []).append(child_wall_and_peak(cmd, env))
    print(f"{'tool':<24}{'wall s':>8}{'peak RSS GB':>13}{'output GB':>11}")
    for tool, r in runs.items():
        wall, peak = min(w for w, _ in r), max(m for _, m in r)
        print(f"{tool:<24}{wall:8.1f}{peak / GB:13.2f}{_size(outputs[tool]) / GB:11.2f}")
    print(f"shardkit checkpoint equal to dcp_to_torch_save's tensors: {_same(out)}")


if __name__ == "__main__":
    main()
