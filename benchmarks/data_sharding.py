"""Data bytes read per rank: a ShardedFiles dataset split by file (each rank reads its own files) against today's
whole-stream reading (a StreamingLoader: every rank reads every file and keeps its share), over one epoch.

Ranks are threads of this process (the sharded loader's collectives go through a thread barrier); bytes are counted
at the file objects the dataset opens (``ShardedFiles.open``), so they are the bytes each rank pulled from storage.

    python benchmarks/data_sharding.py [--files 32] [--rows 2000] [--worlds 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from shardkit.data.sharded_files import ShardedFiles
from shardkit.data.sharded_loader import ShardedLoader
from shardkit.data.streaming import StreamingLoader

CPU = torch.device("cpu")


class _Counted:
    """A file object that adds every byte it returns to ``counter[0]``."""

    def __init__(self, f, counter):
        self.f, self.counter = f, counter

    def read(self, *args):
        data = self.f.read(*args)
        self.counter[0] += len(data)
        return data

    def readline(self, *args):
        return self.read_counted(self.f.readline(*args))

    def read_counted(self, data):
        self.counter[0] += len(data)
        return data

    def __iter__(self):
        for line in self.f:
            yield self.read_counted(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


class CountedFiles(ShardedFiles):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bytes_read, self.opened = [0], 0

    def open(self, url):
        self.opened += 1
        return _Counted(super().open(url), self.bytes_read)


def _thread_gather(world):
    barrier, slots = threading.Barrier(world, timeout=600), [None] * world

    def for_rank(rank):
        def all_gather(tensor):
            slots[rank] = tensor.clone()
            barrier.wait()
            out = torch.stack(slots)
            barrier.wait()
            return out
        return all_gather
    return for_rank


def _epoch(world, build, pattern):
    """Each rank's (bytes read, files opened, samples served) over one epoch, ranks as threads."""
    results, gather = [None] * world, _thread_gather(world)

    def run(rank):
        files = CountedFiles(pattern)
        loader = build(files, rank, gather(rank))
        samples = 0
        for batch in loader:
            samples += 0 if getattr(loader, "repeated", False) else len(batch["id"])
        results[rank] = (files.bytes_read[0], files.opened, samples)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=32)
    parser.add_argument("--rows", type=int, default=2000, help="rows per file")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for f in range(args.files):
            lines = (json.dumps({"id": f * args.rows + i, "text": "x" * 80}) for i in range(args.rows))
            Path(tmp, f"part-{f:04d}.jsonl").write_text("\n".join(lines) + "\n")
        pattern = f"file://{tmp}/*.jsonl"
        total = sum(p.stat().st_size for p in Path(tmp).iterdir())
        print(f"{args.files} jsonl files, {args.rows} rows each, {total / 2**20:.1f} MiB in all; one epoch, "
              f"batch {args.batch_size} per rank")
        print(f"{'ranks':>5} | {'whole stream: MiB/rank':>22} {'files/rank':>10} | {'sharded: MiB/rank':>17} "
              f"{'(max)':>7} {'files/rank':>10} | {'ratio':>6} | samples served (both)")

        def stream(files, rank, _gather):
            return StreamingLoader(DataLoader(files, batch_size=args.batch_size), rank, world, 0, CPU)

        def sharded(files, rank, gather):
            return ShardedLoader(DataLoader(files, batch_size=args.batch_size), rank, world, 0, CPU, gather)

        for world in args.worlds:
            whole, split = _epoch(world, stream, pattern), _epoch(world, sharded, pattern)
            w_mib = sum(b for b, _, _ in whole) / world / 2**20
            s_mib = sum(b for b, _, _ in split) / world / 2**20
            s_max = max(b for b, _, _ in split) / 2**20
            served = sum(n for _, _, n in split)
            assert served == args.files * args.rows, served
            print(f"{world:>5} | {w_mib:>22.2f} {sum(o for _, o, _ in whole) / world:>10.1f} | {s_mib:>17.2f} "
                  f"{s_max:>7.2f} {sum(o for _, o, _ in split) / world:>10.1f} | {w_mib / s_mib:>5.1f}x | "
                  f"{sum(n for _, _, n in whole)} / {served}")

if __name__ == "__main__":
    main()
