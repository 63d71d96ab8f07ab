"""Issue 13 L, M, K under the `shardkit launch` CLI and SIGTERM to a `shardkit.launch()` parent.

Each case starts a real job (2 ranks, gloo on CPU), with collective timeouts of a few seconds, and checks
that it ends, how, and that no process of it survives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Each rank writes its pid to PIDS/<rank> once it runs, and a line to PIDS/<rank>.saved when its SIGTERM
# handler runs (the "save" the grace is for).
RANK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from shardkit.distributed import init_distributed

    pids, mode = Path(sys.argv[1]), sys.argv[2]
    env = init_distributed("cpu")

    def on_term(signum, frame):
        (pids / f"{env.rank}.saved").write_text("saved")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    dist.all_reduce(torch.ones(1))
    (pids / str(env.rank)).write_text(str(os.getpid()))
    if mode == "sleep_all":
        time.sleep(300)
    if mode == "rank1_sleeps_before_collective" and env.rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(300)
    if mode == "rank1_sleeps_after_last_collective" and env.rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(300)
        sys.exit(0)
    if mode != "rank1_sleeps_after_last_collective":
        dist.all_reduce(torch.ones(1))
    if mode == "rank1_sleeps_after_last_collective":
        os._exit(0)  # rank 0 leaves without a final barrier: only the launcher can end rank 1
    dist.destroy_process_group()
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(paths: list[Path], seconds: float) -> None:
    end = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert time.monotonic() < end, f"ranks never started: {[p for p in paths if not p.exists()]}"
        time.sleep(0.2)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_cli(tmp_path: Path, mode: str, *flags: str) -> tuple[subprocess.Popen, Path]:
    script, pids = tmp_path / "rank.py", tmp_path / "pids"
    script.write_text(RANK_SCRIPT)
    pids.mkdir()
    env = {**os.environ, "SHARDKIT_COLLECTIVE_TIMEOUT": "4"}
    # The CLI runs as a foreground command would: a job started in the background (as CI may start this
    # suite) inherits SIGINT ignored, and the launcher rightly leaves an ignored signal ignored.
    process = subprocess.Popen([sys.executable, "-m", "shardkit.cli", "launch", "--num-processes", "2", *flags,
                                str(script), str(pids), mode], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    return process, pids


def _pids(pids: Path) -> list[int]:
    return [int((pids / str(r)).read_text()) for r in (0, 1) if (pids / str(r)).exists()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_cli_reaches_every_rank_which_saves_and_nothing_survives(tmp_path, sig):
    process, pids = _start_cli(tmp_path, "sleep_all", "--stop-grace", "10")
    _wait_for([pids / "0", pids / "1"], 120)
    ranks = _pids(pids)

    process.send_signal(sig)
    out, err = process.communicate(timeout=60)

    assert (pids / "0.saved").exists() and (pids / "1.saved").exists(), err  # each rank's handler ran
    assert not any(_alive(pid) for pid in ranks)
    assert f"got {signal.Signals(sig).name}" in err
    assert process.returncode != 0


def test_cli_kills_ranks_that_ignore_sigterm_after_the_grace(tmp_path):
    process, pids = _start_cli(tmp_path, "sleep_all", "--stop-grace", "2")
    _wait_for([pids / "0", pids / "1"], 120)
    ranks = _pids(pids)
    for pid in ranks:  # a rank stuck where it cannot act on SIGTERM
        os.kill(pid, signal.SIGSTOP)

    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)

    assert not any(_alive(pid) for pid in ranks)
    assert process.returncode == 128 + signal.SIGTERM or process.returncode == -signal.SIGTERM


def test_cli_names_the_rank_that_did_not_arrive(tmp_path):
    process, pids = _start_cli(tmp_path, "rank1_sleeps_before_collective")
    out, err = process.communicate(timeout=150)

    assert process.returncode != 0
    assert "shardkit: rank 0: a collective timed out after 4 s waiting for rank 1, which did not arrive" in err
    assert "root cause: rank(s) [1] hung" in err  # the launcher's summary
    assert not any(_alive(pid) for pid in _pids(pids))


def test_cli_ends_a_job_whose_rank_hangs_after_its_last_collective(tmp_path):
    process, pids = _start_cli(tmp_path, "rank1_sleeps_after_last_collective", "--stop-grace", "2")
    out, err = process.communicate(timeout=150)  # rank 1 sleeps 300 s: this returns only if the job is ended

    assert process.returncode != 0
    assert "rank(s) [1] still running 7 s after rank(s) [0] exited" in err
    assert not any(_alive(pid) for pid in _pids(pids))


PARENT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import shardkit

    def work(folder):
        folder = Path(folder)
        rank = os.environ["RANK"]

        def on_term(signum, frame):
            (folder / f"{rank}.saved").write_text("saved")
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_term)
        (folder / rank).write_text(str(os.getpid()))
        time.sleep(300)

    if __name__ == "__main__":
        shardkit.launch(work, args=(sys.argv[1],), num_processes=2, stop_grace=10)
""")


def test_sigterm_to_a_launch_parent_reaches_every_rank_and_the_parent_dies_of_it(tmp_path):
    script, pids = tmp_path / "parent.py", tmp_path / "pids"
    script.write_text(PARENT_SCRIPT)
    pids.mkdir()
    process = subprocess.Popen([sys.executable, str(script), str(pids)], stderr=subprocess.PIPE, text=True)
    _wait_for([pids / "0", pids / "1"], 120)
    ranks = _pids(pids)

    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)

    assert (pids / "0.saved").exists() and (pids / "1.saved").exists()
    assert not any(_alive(pid) for pid in ranks)
    assert process.returncode == -signal.SIGTERM
