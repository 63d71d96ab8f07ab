"""GPU check (issue 27): a real CUDA out-of-memory under the Runner leaves a memory snapshot and a report.

Runs a Runner loop with ``memory_snapshot=True`` in a child process whose model's forward keeps a tensor of a fixed
size per step until the GPU is full; the out-of-memory error ends the child as it would end a user's script. The
parent then checks that ``profile/oom_snapshot.rank0.pickle`` and ``oom_report.rank0.json`` exist, that both name the
failing allocation (the chunk size, as the allocator rounded it), that the report holds the last steps, the memory
summary and the ``shardkit estimate-memory`` fix, and that the checkpoint saved before the error loads. Prints one
PASS/FAIL line per check; exit status 0 only when all pass. Files go under $OUT/oom_snapshot when $OUT is set.
Needs only the standard library, torch (2.11 or later) and shardkit; 20 s on an H200 (torch 2.11.0+cu130).

    python scripts/gpu_checks/oom_snapshot.py
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

CHUNK_FRACTION = 5  # each step keeps free/5 bytes: the 5th or 6th step fails, after a few real optimizer steps
ROUNDING = 2 * 2**20  # the caching allocator rounds large blocks up to 2 MiB


def child(folder: Path, checkpoints: Path) -> None:
    import torch
    from torch import nn

    from shardkit import Runner

    free, _ = torch.cuda.mem_get_info()
    chunk = free // CHUNK_FRACTION // ROUNDING * ROUNDING + 1024  # not a round size: easy to find in the files
    print(f"chunk={chunk}", flush=True)
    kept: list[torch.Tensor] = []

    class Hog(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kept.append(torch.empty(chunk, dtype=torch.uint8, device=x.device))  # what a leak looks like
            return self.linear(x)

    runner = Runner(logging_dir=folder, memory_snapshot=True, seed=0)
    model = Hog()
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(10 * CHUNK_FRACTION):
        loss = model(torch.randn(8, 64, device=runner.device)).square().mean()
        runner.backward(loss)
        runner.step()
        if step == 1:
            runner.save(checkpoints / "step-2", {"model": model, "optimizer": optimizer})
    raise SystemExit("no out-of-memory error after all: the GPU has more memory than it said")


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}", flush=True)
    return ok


def snapshot_names(snapshot: Path, chunk: int) -> bool:
    """The snapshot's device trace holds an 'oom' event for the chunk (its size as the allocator rounded it)."""
    with snapshot.open("rb") as f:
        data = pickle.load(f)  # our own file, just written by the child
    events = [e for trace in data.get("device_traces", []) for e in trace if e.get("action") == "oom"]
    return any(chunk <= e.get("size", 0) <= chunk + ROUNDING for e in events)


def parent() -> int:
    import torch

    if not torch.cuda.is_available():
        print("FAIL cuda: no CUDA device")
        return 1
    # Three files, two folders down, under $OUT/oom_snapshot: beside other checks' logs in the device tool's $OUT.
    folder = Path(os.environ["OUT"]) / "oom_snapshot" if os.environ.get("OUT") else Path(tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)
    checkpoints = Path(tempfile.mkdtemp(prefix="oom_snapshot_ckpt_"))  # not under $OUT: 8 files come back
    run = subprocess.run([sys.executable, __file__, "--child", str(folder), str(checkpoints)], capture_output=True,
                         text=True, timeout=300)
    (folder / "child.log").write_text(run.stdout + run.stderr)
    results = [check("child ended with the out-of-memory error", run.returncode != 0 and "OutOfMemoryError"
                     in run.stderr, run.stderr[-1500:])]
    chunk = next((int(line[6:]) for line in run.stdout.splitlines() if line.startswith("chunk=")), 0)
    snapshot = folder / "profile" / "oom_snapshot.rank0.pickle"
    report_path = folder / "oom_report.rank0.json"
    results.append(check("snapshot written", snapshot.is_file(), str(snapshot)))
    results.append(check("snapshot names the failing allocation", snapshot.is_file() and snapshot_names(
        snapshot, chunk), f"no 'oom' event of {chunk} bytes"))
    results.append(check("report written", report_path.is_file(), str(report_path)))
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        asked = report.get("failing_allocation_bytes") or 0
        results.append(check("report names the failing allocation", chunk <= asked <= chunk + ROUNDING,
                             f"{asked} vs chunk {chunk}"))
        results.append(check("report names the snapshot", report.get("snapshot") == str(snapshot)))
        results.append(check("report holds the last steps", len(report.get("last_steps", [])) >= 2))
        results.append(check("report holds the CUDA memory summary", "cuda" in report.get("memory", {})))
        results.append(check("report names the fix", "shardkit estimate-memory --params" in report.get("fix", "")))
        results.append(check("stderr points at the report", str(report_path) in run.stderr))
    results.append(check("checkpoint before the error loads", checkpoint_loads(checkpoints)))
    print("PASS all" if all(results) else "FAIL some checks", flush=True)
    return 0 if all(results) else 1


def checkpoint_loads(checkpoints: Path) -> bool:
    import torch
    from torch import nn

    from shardkit import Runner

    try:
        runner = Runner(logging_dir=checkpoints / "runs")
        model = runner.setup(nn.ModuleDict({"linear": nn.Linear(64, 64)}))  # the child's Hog without its hog
        runner.load(checkpoints, {"model": model}, runner_state=False)
        runner.teardown()
        return bool(torch.isfinite(model["linear"].weight).all())
    except Exception as err:  # noqa: BLE001 - reported as a FAIL line
        print(f"  load failed: {type(err).__name__}: {err}")
        return False


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(parent())
