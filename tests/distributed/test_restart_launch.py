"""`shardkit launch --max-restarts`: a job killed at random moments finishes by itself with the uninterrupted
run's losses and weights; a job that crashes the same way at step 0 stops after two attempts, naming its error.
The job is scripts/restart_job.py (2 ranks of DDP on CPU); the in-process parts are tests/unit/test_restart.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

JOB = Path(__file__).parent / "scripts" / "restart_job.py"


def _launch(out: Path, *job_args: str, processes: int = 2) -> subprocess.CompletedProcess:
    out.mkdir()
    env = {**os.environ, "SHARDKIT_COLLECTIVE_TIMEOUT": "90"}
    return subprocess.run([sys.executable, "-m", "shardkit.cli", "launch", "--num-processes", str(processes),
                           "--max-restarts", "5", str(JOB), str(out), *job_args],
                          capture_output=True, text=True, timeout=850, env=env)


def test_killed_three_times_ends_with_the_uninterrupted_losses_and_weights(tmp_path):
    done = _launch(tmp_path / "out", "--steps", "20", "--kill-seed", "7")
    err = done.stderr
    assert done.returncode == 0, err[-4000:]
    for attempt in (1, 2, 3):
        assert f"attempt {attempt} failed" in err and "killed by SIGKILL" in err, err[-4000:]
    assert "attempt 4 failed" not in err
    assert "time lost per failure" in err and "failure 3:" in err, err[-3000:]
    out = tmp_path / "out"
    for rank in (0, 1):
        final = torch.load(out / f"final.rank{rank}.pt")
        reference = dict(final["reference_losses"])
        assert sorted(reference) == list(range(1, 21))
        seen: dict[int, set[float]] = {}
        for attempt in range(4):
            for line in (out / f"losses.{attempt}.rank{rank}.jsonl").read_text().splitlines():
                record = json.loads(line)
                seen.setdefault(record["step"], set()).add(record["loss"])
        # every step, replayed ones included, has exactly the loss of the run that was never interrupted
        assert seen == {step: {loss} for step, loss in reference.items()}
        for key, value in final["reference"].items():
            assert torch.equal(final["weights"][key], value), key
    trained = sum(len((out / f"losses.{a}.rank0.jsonl").read_text().splitlines()) for a in range(4))
    assert trained > 20  # the kills cost replayed steps: the comparison above covered them


def test_the_same_crash_twice_without_progress_stops_with_its_error(tmp_path):
    done = _launch(tmp_path / "out", "--crash", processes=1)
    err = done.stderr
    assert done.returncode != 0
    assert "stopping: attempt 2 failed the same way as attempt 1 and made no progress" in err, err[-4000:]
    assert "RuntimeError: crash at step 0 on purpose (rank 0)" in err
    started = sorted(p.name for p in (tmp_path / "out").glob("started.*"))
    assert started == ["started.0.rank0", "started.1.rank0"]  # two attempts, not the six --max-restarts 5 allows
