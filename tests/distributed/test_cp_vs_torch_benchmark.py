"""benchmarks/context_parallel.py --vs-torch cannot rot: its CPU path runs end to end on 2 gloo ranks (shardkit's
ring ContextParallel trains; torch's side reports that it needs CUDA, with the probe's reason), and the CUDA report
(ratio, loss gap, peak memory) is formatted from a result of the shape the CUDA workers return."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    # by path, not by putting benchmarks/ on sys.path (its scripts would shadow real modules for later tests)
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
def test_vs_torch_cpu_path_trains_shardkit_and_says_why_torch_does_not_run():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), "--vs-torch", "--cps", "2", "--seq", "64",
           "--hidden", "64", "--layers", "1", "--heads", "4", "--vocab", "128", "--steps", "1", "--timeout", "120"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path even where a GPU is visible
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("cp=2 on cpu: shardkit ContextParallel(ring) step ") for line in lines), done.stdout
    skipped = next(line for line in lines if line.startswith("cp=2: torch side not run: "))
    assert "needs CUDA" in skipped and "_scaled_dot_product_flash_attention_for_cpu" in skipped
    losses = [float(v) for v in next(line for line in lines if line.startswith("cp=2: shardkit losses ")).split()[3:]]
    assert len(losses) == 3  # 2 warm-up steps + 1 timed
    # a fresh model predicts about uniformly over the 128-token vocabulary
    assert all(math.isfinite(v) for v in losses) and abs(losses[0] - math.log(128)) < 0.3, losses


def test_cuda_report_prints_ratio_loss_gap_and_peak():
    bench = _load("context_parallel_vs_torch")
    side = {"step_s": 0.1, "losses": [10.4, 10.2], "peak": 3 * 2**30}
    lines = bench._report(1, {"device": "cuda:0", "shardkit": {**side, "step_s": 0.102},
                              "torch": {**side, "losses": [10.41, 10.22], "peak": 4 * 2**30}})
    text = "\n".join(lines)
    assert "ratio shardkit/torch 1.020" in text and "peak ratio 0.75" in text
    assert "largest loss gap 0.0200" in text and "torch losses 10.4100 10.2200" in text
