"""Issue 27: a rank that the kernel's out-of-memory killer really ends (no simulated SIGKILL) is named by
`shardkit launch`: the signal, the memory it was seen holding, the OOM kill counted, and the estimate-memory command.

The job runs inside a memory cgroup of its own (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, 1.2 GiB), so the
kill stays inside the test's processes; where no cgroup can be made (not root, read-only hierarchy) the test skips
and says why."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1200 * 2**20


def _memory_cgroup() -> tuple[Path, str] | None:
    """A fresh memory cgroup with this test's limit written, or None where none can be made."""
    name = f"shardkit-oom-test-{uuid.uuid4().hex[:8]}"
    # (limit, memory+swap limit): without the second a host with swap pages the leak out instead of killing it
    for parent, limits in ((Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")),
                           (Path("/sys/fs/cgroup"), ("memory.max", "memory.swap.max"))):
        if not (parent / limits[0]).exists() and not (parent / "cgroup.controllers").exists():
            continue
        group = parent / name
        try:
            group.mkdir()
            (group / limits[0]).write_text(str(LIMIT))
            if (group / limits[1]).exists():
                (group / limits[1]).write_text(str(LIMIT) if limits[1].startswith("memory.memsw") else "0")
            return group, limits[0]
        except OSError:
            if group.exists():
                group.rmdir()
    return None


def _empty_and_remove(group: Path) -> None:
    """Kill whatever is still in the group (a run that timed out leaves its ranks there), then remove it."""
    import signal
    import time

    for _ in range(50):
        try:
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        group.rmdir()


@pytest.mark.skipif(sys.platform != "linux", reason="the OOM killer and cgroups are Linux's")
def test_a_rank_the_oom_killer_ends_is_named_with_its_memory_and_the_estimate_command():
    made = _memory_cgroup()
    if made is None:
        pytest.skip("no memory cgroup can be made here (needs root and a writable /sys/fs/cgroup)")
    group, _ = made
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    try:
        # the shell joins the cgroup first, so the launcher and both ranks are born inside it
        run = subprocess.run(
            ["bash", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$0" -m shardkit.cli launch '
                           f'--num-processes 2 "{ROOT}/tests/faults/probe_oom_kill.py"', sys.executable],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    finally:
        _empty_and_remove(group)
    err = run.stderr
    assert run.returncode != 0
    assert "rank 1 was killed by SIGKILL (exit -9, 137 in a shell)" in err, err[-3000:]
    assert "the kernel's out-of-memory killer ended it" in err, err[-3000:]
    seen = float(err.split("137 in a shell), ")[1].split(" GiB")[0])
    assert 0.3 < seen <= LIMIT / 2**30  # what the supervisor last read, under the cap
    assert "what fits: shardkit estimate-memory --params 65792 --num-gpus 2" in err
    assert "rank 0 (local rank 0" in err and "the launcher stops the other ranks when one fails" in err
