"""Training stall per save of a 1 GiB state: ``runner.save(..., blocking=True)`` vs ``blocking=False``.

    python benchmarks/async_checkpoint.py [--gib 1.0] [--rounds 3] [--steps 100] [--dir /tmp]

A loop of ``--steps`` training steps of a small MLP (the work a step does) saves the 1 GiB state (16 fp32
matrices, benchmarks/checkpoint_io.py's Blob) once, at its fifth step. The stall is the loop's time minus the same
loop without a save, measured in the same round: for the blocking save that is the save; for the background one it
is the staging copy on the main thread plus whatever the writer thread takes from the step (2 shared cores here).
The background save must have finished by the end of the loop: ``wait_for_save`` after it is timed apart (what is
left of the write) and is not a stall of the loop. Rounds rotate the three loops; medians are printed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _timing import machine_description, print_table
from checkpoint_io import Blob

from shardkit import Runner


def _loop(runner: Runner, mlp: torch.nn.Module, optimizer, steps: int, save=None) -> tuple[float, float, float]:
    """(loop seconds, seconds inside save(), seconds waiting for the background save after the loop)."""
    x = torch.randn(256, 512)
    in_save = 0.0
    start = time.perf_counter()
    for step in range(steps):
        loss = mlp(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if save is not None and step == 4:
            t = time.perf_counter()
            save()
            in_save = time.perf_counter() - t
    loop = time.perf_counter() - start
    t = time.perf_counter()
    runner.wait_for_save()
    return loop, in_save, time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    torch.manual_seed(0)
    runner = Runner(checkpoint_keep_last=1)
    blob = runner.setup(Blob(args.gib))
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    optimizer = torch.optim.AdamW(mlp.parameters(), lr=1e-4)
    root = Path(tempfile.mkdtemp(prefix="shardkit-async-bench-", dir=args.dir))
    loops = {
        "no save": lambda i: None,
        "blocking save": lambda i: (lambda: runner.save(root / f"s{i}", {"model": blob})),
        "background save": lambda i: (lambda: runner.save(root / f"a{i}", {"model": blob}, blocking=False)),
    }
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in loops}
    _loop(runner, mlp, optimizer, args.steps, loops["background save"](-1))  # warm-up: buffers, page cache
    for i in range(args.rounds):
        names = list(loops)[i % 3:] + list(loops)[:i % 3]
        for name in names:
            times[name].append(_loop(runner, mlp, optimizer, args.steps, loops[name](i)))
    base = statistics.median(t[0] for t in times["no save"])
    rows, stall = [], {}
    for name, runs in times.items():
        loop = statistics.median(t[0] for t in runs)
        stall[name] = loop - base
        rows.append([name, f"{loop:.2f} s", f"{stall[name]:.2f} s", f"{statistics.median(t[1] for t in runs):.3f} s",
                     f"{statistics.median(t[2] for t in runs):.3f} s", " ".join(f"{t[0]:.2f}" for t in runs)])
    runner.teardown()
    print(machine_description())
    print(f"state {blob.nbytes() / 2**30:.2f} GiB, {args.steps} steps a loop, one save at step 5, {args.rounds} rounds")
    print_table(["loop", "median loop", "stall vs no save", "in save()", "wait after loop", "per round"], rows)
    ratio = stall["background save"] / stall["blocking save"] if stall["blocking save"] > 0 else float("nan")
    print(f"background save's stall / blocking save's stall = {ratio:.3f}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
