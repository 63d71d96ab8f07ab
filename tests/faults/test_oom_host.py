"""A real out-of-memory on the host (RLIMIT_AS in a child process) leaves the report issue 27 promises.

The child (probe_oom.py) trains, saves step-2, caps its address space and leaks 16 MiB per step until an allocation
fails; the error ends it as it would end a user's script. Both host failures are provoked, side by side: the CPU
allocator's RuntimeError (tensors) and Python's MemoryError (bytearrays).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from shardkit import Runner

HERE = Path(__file__).parent
CHUNK = 16 * 2**20 + 1024  # probe_oom.CHUNK
PARAMS = 32 * 32 + 32  # probe_oom's nn.Linear(32, 32)


def _check_report(folder: Path, stderr: str, kind: str) -> None:
    path = folder / "runs" / "oom_report.rank0.json"
    assert path.is_file(), stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["error"]["type"] == ("RuntimeError" if kind == "torch" else "MemoryError")
    assert report["failing_allocation_bytes"] == (CHUNK if kind == "torch" else None)
    host = report["memory"]["host"]
    assert host["address_space_limit_bytes"] > 0 and 0 < host["rss_bytes"] <= host["peak_rss_bytes"]
    steps = report["last_steps"]  # the flight recorder: the steps before the failure, in order, with their loss
    assert len(steps) >= 3 and [r["step"] for r in steps] == list(range(steps[0]["step"], steps[-1]["step"] + 1))
    assert all(isinstance(r["loss"], float) and r["host_rss_bytes"] > 0 for r in steps)
    assert f"shardkit estimate-memory --params {PARAMS} --num-gpus 1 --num-nodes 1 --precision fp32" in report["fix"]
    assert "the host ran out of memory" in report["fix"] and report["snapshot"] is None
    assert str(path) in stderr and "out of memory on rank 0" in stderr  # the log line says where it is


def _check_checkpoint(folder: Path) -> None:
    """The step-2 checkpoint saved before the leak is whole: it loads with every hash checked."""
    assert (folder / "ckpt" / "latest").read_text().strip() == "step-2"
    runner = Runner(logging_dir=folder / "load")
    model = runner.setup(nn.ModuleDict({"linear": nn.Linear(32, 32)}))  # probe_oom's Leaky without its leak
    before = model["linear"].weight.detach().clone()
    runner.load(folder / "ckpt", {"model": model}, verify=True)
    assert runner.optimizer_steps == 2 and not torch.equal(model["linear"].weight, before)
    runner.teardown()


def test_a_real_host_oom_writes_the_report_and_keeps_the_checkpoint(tmp_path):
    children = {kind: subprocess.Popen([sys.executable, str(HERE / "probe_oom.py"), kind, str(tmp_path / kind)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for kind in ("torch", "python")}
    for kind, child in children.items():
        _, stderr = child.communicate(timeout=240)
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        assert child.returncode == 1, stderr[-3000:]
        assert last.startswith("RuntimeError: [enforce fail" if kind == "torch" else "MemoryError"), last
        _check_report(tmp_path / kind, stderr, kind)
        _check_checkpoint(tmp_path / kind)
