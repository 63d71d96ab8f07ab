"""The contract at one process under a launcher: every registered strategy, and every one registered later with no
edit here, sets up, steps (the loss falls) and tears down its process group in a job of one process started by
``torchrun --nproc_per_node 1`` (``shardkit launch --num_processes 1`` is torchrun underneath; its one-process run of
FSDP and ZeRO-3 is tests/distributed/test_launch.py's seed-script case, which keeps this suite's time down).

A lone torchrun worker's rendezvous is a client of the agent's store (TORCHELASTIC_USE_AGENT_STORE): a strategy that
made a private group there waited for ever. Each launch runs every strategy in turn in one process
(``one_process_launch.py``); a hang fails the test at the timeout instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from contract_workers import strategy_names

pytest.importorskip("deepspeed")  # four of the registered strategies are DeepSpeed's engine

SCRIPT = Path(__file__).resolve().parent / "one_process_launch.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"],
}
# Every strategy's setup and 4 steps of the tiny Llama take ~1-2 min on a loaded 2-core machine, plus DeepSpeed's
# async_io build (ZeROInfinity's NVMe swap) if this is the suite's first use of it (~4 min); a hang never ends.
TIMEOUT_S = 1000


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_every_strategy_runs_in_a_one_process_launch(tmp_path, launcher):
    out = tmp_path / "results.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "SHARDKIT_NVME_PATH": str(tmp_path / "nvme"),
           "SHARDKIT_COLLECTIVE_TIMEOUT": "60"}
    try:
        done = subprocess.run([*LAUNCHERS[launcher], str(SCRIPT), str(out)], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{launcher} with one process hung for {TIMEOUT_S} s; its output:\n{err.stdout}\n{err.stderr}",
                    pytrace=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert list(results) == strategy_names()
    for name, result in results.items():
        assert "error" not in result, f"{name} under {launcher}:\n{result['error']}"
        losses = result["losses"]
        assert result["world_size"] == 1 and losses[-1] < losses[0], (name, result)
        # Every strategy with a process group joins the launcher's, even at one process (DDP included).
        assert result["group"] is result["process_group_strategy"] and result["group_size"] in (None, 1), \
            (name, result)
