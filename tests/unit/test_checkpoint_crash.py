"""A process SIGKILLed in the middle of a save leaves the previous checkpoint and `latest` whole."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from shardkit.checkpoint import CheckpointReader, CheckpointWriter, resolve_checkpoint

# The child saves step-1, then starts step-2 and, at the hook point, signals readiness and sleeps until
# it is killed: the kill lands at a known point, no timing involved.
CHILD = textwrap.dedent("""
    import sys, time, pathlib, torch
    import shardkit.checkpoint.format as fmt
    import shardkit.checkpoint.writer as wr
    from shardkit.checkpoint import CheckpointWriter

    root, ready, hook = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    with CheckpointWriter(root / "step-1") as w:
        w.write_tensors("model", {f"p{i}": torch.full((64,), float(i)) for i in range(8)})
        w.write_json("trainer_state", {"step": 1})

    def stall():
        ready.write_text("x")
        time.sleep(600)

    if hook == "mid-write":
        real, count = fmt.SafetensorsStreamWriter.write, [0]
        def write(self, name, tensor):
            real(self, name, tensor)
            count[0] += 1
            if count[0] == 20:  # 20 of the 200 tensors of step-2 are on disk
                self._f.flush()
                stall()
        fmt.SafetensorsStreamWriter.write = write
    else:  # directory renamed into place, `latest` not yet moved
        wr.update_latest = lambda path: stall()

    with CheckpointWriter(root / "step-2") as w:
        w.write_tensors("model", {f"p{i}": torch.full((4096,), -1.0) for i in range(200)})
        w.write_json("trainer_state", {"step": 2})
""")


@pytest.mark.parametrize("hook", ["mid-write", "before-latest"])
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, hook):
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(ready), hook])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, f"child exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "child never reached the hook"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    assert (root / "latest").read_text().strip() == "step-1"
    assert resolve_checkpoint(root) == root / "step-1"
    r = CheckpointReader(root, verify=True)
    assert r.read_json("trainer_state") == {"step": 1}
    assert torch.equal(r.read_full("model", "p3"), torch.full((64,), 3.0))
    if hook == "mid-write":
        assert len(list(root.glob(".step-2.tmp-*"))) == 1 and not (root / "step-2").exists()
    else:  # the new directory is complete; only the pointer did not move
        assert CheckpointReader(root / "step-2", verify=True).read_json("trainer_state") == {"step": 2}

    # the next save cleans up and moves `latest`
    with CheckpointWriter(root / "step-2") as w:
        w.write_json("trainer_state", {"step": 2})
    assert not list(root.glob(".step-2.tmp-*"))
    assert CheckpointReader(root).read_json("trainer_state") == {"step": 2}
