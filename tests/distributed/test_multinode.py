"""A two-"machine" job on this machine: two `shardkit launch --num-machines 2 --machine-rank R` invocations form
one job of 2 x 2 ranks (issue 13, "Beyond one machine").

Checks that DDP and FSDP hybrid sharding (shard inside a machine, replicate across) give the losses of the
same 4 ranks on one machine, and that a machine dying ends the other's ranks with a message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from shardkit.launch import find_free_port

pytestmark = pytest.mark.distributed

TRAIN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from shardkit import DDP, FSDP, Runner

    kind, out = sys.argv[1], Path(sys.argv[2])
    strategy = DDP() if kind == "ddp" else FSDP(sharding="hybrid", hybrid_shard_size=2, auto_wrap=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    runner = Runner(strategy=strategy)
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (out / f"pid-{runner.rank}").write_text(str(os.getpid()))
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=data), torch.randn(32, 1, generator=data)
    shard = slice(runner.rank * 8, runner.rank * 8 + 8)  # each rank its own quarter of the batch
    losses = []
    for step in range(6 if kind != "die" else 10_000):
        loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
        runner.backward(loss)
        runner.step()
        losses.append(runner.strategy.all_reduce(loss.detach().clone(), "mean").item())
        if kind == "die":
            time.sleep(0.2)
    if runner.rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
    runner.teardown()
""")


def _launch(tmp_path: Path, kind: str, out: Path, *flags: str, new_session: bool = False) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out.mkdir(exist_ok=True)
    env = {**os.environ, "SHARDKIT_COLLECTIVE_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "shardkit.cli", "launch", *flags, str(script), kind, str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


def _two_machines(tmp_path: Path, kind: str, out: Path) -> list[subprocess.Popen]:
    port = str(find_free_port())
    return [_launch(tmp_path, kind, out, "--num-processes", "2", "--num-machines", "2", "--machine-rank", str(r),
                    "--main-process-ip", "127.0.0.1", "--main-process-port", port) for r in (0, 1)]


@pytest.mark.parametrize("kind", ["ddp", "fsdp_hybrid"])
def test_two_machines_of_two_ranks_give_the_single_machine_losses(tmp_path, kind):
    machines = _two_machines(tmp_path, kind, tmp_path / "two")
    results = [m.communicate(timeout=300) for m in machines]
    for machine, (_, err) in zip(machines, results):
        assert machine.returncode == 0, err[-3000:]
    single = _launch(tmp_path, kind, tmp_path / "one", "--num-processes", "4")
    _, err = single.communicate(timeout=300)
    assert single.returncode == 0, err[-3000:]

    two = json.loads((tmp_path / "two" / "losses.json").read_text())
    one = json.loads((tmp_path / "one" / "losses.json").read_text())
    assert two[-1] < two[0]  # it trains
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-7)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_dying_machine_ends_the_other_machines_ranks_with_a_message(tmp_path):
    out = tmp_path / "die"
    port = str(find_free_port())
    flags = ["--num-processes", "2", "--num-machines", "2", "--main-process-ip", "127.0.0.1",
             "--main-process-port", port]
    survivor = _launch(tmp_path, "die", out, *flags, "--machine-rank", "0")
    victim = _launch(tmp_path, "die", out, *flags, "--machine-rank", "1", new_session=True)
    deadline = time.monotonic() + 180
    while not all((out / f"pid-{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline and survivor.poll() is None, "the job never started"
        time.sleep(0.5)

    # Machine 1 loses power: its launcher, torchrun and both ranks die at once.
    for rank in (2, 3):
        os.kill(int((out / f"pid-{rank}").read_text()), signal.SIGKILL)
    os.killpg(victim.pid, signal.SIGKILL)
    _, err = survivor.communicate(timeout=120)
    victim.communicate()

    assert survivor.returncode != 0
    assert not any(_alive(int((out / f"pid-{r}").read_text())) for r in (0, 1))
    assert "Connection closed by peer" in err or "Connection reset by peer" in err, err[-3000:]
