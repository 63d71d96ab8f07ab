"""Save and load time of a 1 GB checkpoint through the Runner, with sha256 verification on and off.

    python benchmarks/checkpoint_io.py [--gib 1.0] [--repeats 3] [--dir /tmp]

The model is 16 fp32 matrices (1 GiB by default). A save always hashes while it writes (the manifest
must hold every file's sha256), so its figure is given once, with sha256 alone on the same bytes beside
it for the hashing share. A load hashes each file while reading it (``verify=True``, the default) or
skips the hash (``verify=False``); both are timed from the page cache (warm: right after a save) and
from disk (cold: the checkpoint's own pages dropped with posix_fadvise(DONTNEED) first, nothing else on
the machine is touched). Rounds alternate on/off so machine noise hits both alike; medians are printed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _timing import machine_description, print_table
from torch import nn

from shardkit import Runner


class Blob(nn.Module):
    """``n`` square fp32 matrices, ``gib`` GiB in all."""

    def __init__(self, gib: float, n: int = 16) -> None:
        super().__init__()
        side = int((gib * 2**30 / n / 4) ** 0.5)
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(side, side), requires_grad=False) for _ in range(n))

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def drop_page_cache(path: Path) -> None:
    """Evicts this checkpoint's pages (they are clean after the save's fsync) so the next read hits the disk."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    runner = Runner(seed=0)
    model, target = Blob(args.gib), Blob(args.gib)
    size = model.nbytes()
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "ckpt"
        ckpt = root / "step-1"
        runner.save(ckpt, {"model": model})  # warm-up: first-touch page faults of the files and buffers
        for r in range(args.repeats):
            times.setdefault("save (sha256 while writing, fsync)", []).append(
                timed(lambda: runner.save(ckpt, {"model": model})))
            for verify in ((True, False) if r % 2 == 0 else (False, True)):  # neither always first after a save
                for cold in (False, True):
                    if cold:
                        drop_page_cache(ckpt)
                    key = f"load verify={verify} ({'cold: from disk' if cold else 'warm: page cache'})"
                    times.setdefault(key, []).append(
                        timed(lambda v=verify: runner.load(root, {"model": target}, verify=v)))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), target.parameters()))
        data = memoryview(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(torch.uint8).numpy())
        times["sha256 alone over the same bytes (in memory)"] = [
            timed(lambda: hashlib.sha256(data).hexdigest()) for _ in range(args.repeats)]
    return [(name, statistics.median(ts), size / statistics.median(ts) / 1e9) for name, ts in times.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: the system temp dir)")
    args = p.parse_args()
    rows = bench(args)
    print(machine_description())
    print(f"checkpoint: {args.gib:g} GiB of fp32 in 16 tensors, median of {args.repeats}")
    print_table(["operation", "seconds", "GB/s"], [[n, f"{s:.3f}", f"{g:.2f}"] for n, s, g in rows])
    on = {n.split("(")[1]: s for n, s, _ in rows if "verify=True" in n}
    off = {n.split("(")[1]: s for n, s, _ in rows if "verify=False" in n}
    for k in on:
        print(f"verify on / off, {k.rstrip(')')}: {on[k] / off[k]:.2f}x")


if __name__ == "__main__":
    main()
