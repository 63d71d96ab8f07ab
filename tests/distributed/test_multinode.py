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

from shardkit.distributed import find_free_port

pytestmark = pytest.mark.distributed

TRAIN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from shardkit import DDP, FSDP, Runner

    kinds, out = sys.argv[1].split(","), Path(sys.argv[2])
    # Hybrid's shard groups default to the processes of one machine; the one-machine run asks for 2 explicitly.
    size = int(os.environ["HYBRID_SHARD_SIZE"]) if os.environ.get("HYBRID_SHARD_SIZE") else None
    for kind in kinds:  # one after the other on the job's one process group
        strategy = DDP() if kind != "fsdp_hybrid" else FSDP(sharding="hybrid", hybrid_shard_size=size, auto_wrap=False)
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
            (out / f"losses-{kind}.json").write_text(json.dumps(losses))
        mesh = getattr(runner.strategy, "mesh", None)
        if mesh is not None:  # which ranks share this rank's shards
            (out / f"shard-group-{kind}-{runner.rank}").write_text(json.dumps(sorted(dist.get_process_group_ranks(
                mesh.get_group("shard")))))
    runner.teardown()
""")


def _launch(tmp_path: Path, kind: str, out: Path, *flags: str,
            hybrid_shard_size: int | None = None) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out.mkdir(exist_ok=True)
    env = {**os.environ, "SHARDKIT_COLLECTIVE_TIMEOUT": "30", "OMP_NUM_THREADS": "1",
           "HYBRID_SHARD_SIZE": str(hybrid_shard_size or "")}
    # Output to a file, not a pipe: a launcher blocked on a full pipe that nobody reads would stall the job.
    log = open(out.parent / f"{out.name}-{len(list(out.parent.glob(f'{out.name}-*.log')))}.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "shardkit.cli", "launch", *flags, str(script), kind,
                                str(out)], env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    process.log = log  # type: ignore[attr-defined]
    return process


def _finish(processes: list[subprocess.Popen], seconds: float) -> list[str]:
    """Wait for every launcher; when one fails or time runs out, kill the rest (their whole sessions).

    Returns each launcher's output; fails the test with all of it when one did not exit 0.
    """
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in processes):
        failed = any(p.poll() not in (None, 0) for p in processes)
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    logs = []
    for process in processes:
        process.log.seek(0)
        logs.append(process.log.read())
        process.log.close()
    codes = [p.returncode for p in processes]
    assert codes == [0] * len(processes), f"exit codes {codes}:\n" + "\n====\n".join(log[-3000:] for log in logs)
    return logs


def _two_machines(tmp_path: Path, kind: str, out: Path) -> list[subprocess.Popen]:
    port = str(find_free_port())
    return [_launch(tmp_path, kind, out, "--num-processes", "2", "--num-machines", "2", "--machine-rank", str(r),
                    "--main-process-ip", "127.0.0.1", "--main-process-port", port) for r in (0, 1)]


KINDS = ["ddp", "fsdp_hybrid"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Both kinds, one after the other in each job: the 2 x 2 job (two launchers) into ``two``, the same 4 ranks on
    one machine into ``one``."""
    root = tmp_path_factory.mktemp("multinode")
    _finish(_two_machines(root, ",".join(KINDS), root / "two"), 600)
    _finish([_launch(root, ",".join(KINDS), root / "one", "--num-processes", "4", hybrid_shard_size=2)], 600)
    return root


@pytest.mark.parametrize("kind", KINDS)
def test_two_machines_of_two_ranks_give_the_single_machine_losses(runs, kind):
    two = json.loads((runs / "two" / f"losses-{kind}.json").read_text())
    one = json.loads((runs / "one" / f"losses-{kind}.json").read_text())
    assert two[-1] < two[0]  # it trains
    if kind == "fsdp_hybrid":  # sharded inside each machine (ranks 0-1, 2-3), replicated across them
        groups = [json.loads((runs / "two" / f"shard-group-{kind}-{r}").read_text()) for r in range(4)]
        assert groups == [[0, 1], [0, 1], [2, 3], [2, 3]]
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
    victim = _launch(tmp_path, "die", out, *flags, "--machine-rank", "1")
    deadline = time.monotonic() + 180
    while not all((out / f"pid-{r}").exists() for r in range(4)):
        assert time.monotonic() < deadline and survivor.poll() is None, "the job never started"
        time.sleep(0.5)

    # Machine 1 loses power: its launcher, torchrun and both ranks die at once.
    for rank in (2, 3):
        os.kill(int((out / f"pid-{rank}").read_text()), signal.SIGKILL)
    os.killpg(victim.pid, signal.SIGKILL)
    survivor.wait(timeout=120)
    victim.wait()
    survivor.log.seek(0)
    err = survivor.log.read()

    assert survivor.returncode != 0
    assert not any(_alive(int((out / f"pid-{r}").read_text())) for r in (0, 1))
    assert "Connection closed by peer" in err or "Connection reset by peer" in err, err[-3000:]
    assert "a peer closed its connection during a collective: that rank died" in err, err[-3000:]
