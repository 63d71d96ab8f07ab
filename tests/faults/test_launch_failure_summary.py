"""A failing rank under ``shardkit launch``: the rank's own traceback and shardkit's short summary, not
torchrun's ChildFailedError traceback and failure table (issue 30)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCRIPT = """
import os
if os.environ["RANK"] == "1":
    raise ValueError("the user's own bug on rank 1")
"""


def test_failing_rank_gets_shardkits_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "shardkit.cli", "launch", "--num-processes", "2", str(script)],
                          capture_output=True, text=True, timeout=280)
    err = done.stderr
    assert done.returncode == 1, err[-3000:]
    assert "ValueError: the user's own bug on rank 1" in err  # the rank's own traceback stays
    assert "ChildFailedError" not in err and "Root Cause" not in err, err[-3000:]
    assert "shardkit launch: 1 rank(s) of" in err and "rank 1 (local rank 1" in err and "exited with code 1" in err
    print(f"\nlaunch failure corpus: 1 probe, {len(err.splitlines())} stderr lines in all")
