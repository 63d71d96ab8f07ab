"""What `shardkit launch` does around torchrun so that every job ends and nothing outlives it.

torchrun stops all ranks when one fails, but in two cases a job would hang for ever or orphan its processes:

* a rank that hangs after its last collective while the others exit 0: torchrun waits for it. Here, once
  a rank of this machine has exited, the others get the collective timeout plus a grace; then the ranks
  still running are named and the job is stopped (non-zero exit).
* SIGTERM/SIGINT to `shardkit launch`: forwarded to torchrun (which passes SIGTERM to its ranks); after
  `stop_grace` seconds everything left, torchrun and every rank's session (DataLoader workers included),
  is killed.

Ranks are torchrun's children, each in its own session (torchrun starts them so); they are found in /proc,
and their rank is read from their environment. After the job, the reports ranks wrote on a collective
timeout (see `shardkit.distributed.watchdog`) are summarised, naming the ranks that did not arrive.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from shardkit.distributed.oom import (
    describe_kill,
    exit_signal,
    oom_kill_count,
    read_exit_signals,
    read_run_facts,
    rss_bytes,
)
from shardkit.distributed.signals import catch_stop_signals, redeliver
from shardkit.distributed.watchdog import REPORT_DIR_ENV, read_reports

__all__ = ["SupervisedOutcome", "run_supervised"]

_POLL_S = 0.2


@dataclass
class _Job:
    process: subprocess.Popen
    workers: dict[int, int] = field(default_factory=dict)  # pid -> rank, every worker ever seen
    exited: dict[int, float] = field(default_factory=dict)  # rank -> when it was first seen gone
    kill_at: float | None = None
    stragglers: list[int] = field(default_factory=list)
    rss: dict[int, int] = field(default_factory=dict)  # rank -> resident bytes when last seen alive
    signals: dict[int, int] = field(default_factory=dict)  # rank -> the signal that ended it, when seen as a zombie
    oom_kills: int | None = None  # the kernel's OOM-kill counters at the start


@dataclass
class SupervisedOutcome:
    """What `run_supervised` saw of a job that ended, for a launcher that restarts it.

    Attributes:
        first_exit: Unix time the first rank was seen gone (None: none was).
        signals: rank -> the signal that ended it.
        hung: ranks named as hung (peers timed out waiting for them, or they outlived the others).
    """

    first_exit: float | None = None
    signals: dict[int, int] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)


def run_supervised(command: Sequence[str], env: Mapping[str, str], straggle_s: float, stop_grace: float,
                   outcome: SupervisedOutcome | None = None) -> int:
    """Run torchrun's `command`, enforce the two rules above, print the summary; the exit code to return.
    `outcome`, when given, is filled with what was seen of the ranks' ends."""
    report_dir = tempfile.mkdtemp(prefix="shardkit-launch-")
    try:
        with catch_stop_signals() as received:
            oom_kills = oom_kill_count()
            job = _Job(subprocess.Popen(list(command), env={**env, REPORT_DIR_ENV: report_dir}), oom_kills=oom_kills)
            try:
                code = _watch(job, straggle_s, stop_grace, received)
            finally:
                _kill_everything(job)
        _summarise(job, report_dir, code)
        if outcome is not None:
            _fill(outcome, job, report_dir)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    if received:
        redeliver(received[0])
    if job.stragglers and code == 0:
        return 1
    # A negative code is death by signal: report it the way a shell does (128 + signal).
    return 128 - code if code < 0 else code


def _watch(job: _Job, straggle_s: float, stop_grace: float, received: list[int]) -> int:
    forwarded = False
    while job.process.poll() is None:
        now = time.monotonic()
        _scan(job, now)
        if received and not forwarded:
            name = signal.Signals(received[0]).name
            print(f"shardkit launch: got {name}; passing SIGTERM to every rank, which has {stop_grace:g} s to "
                  f"save before it is killed", file=sys.stderr, flush=True)
            forwarded = True
            _stop(job, now + stop_grace)
        straggle_at = min(job.exited.values()) + straggle_s if job.exited else None
        if not forwarded and straggle_at is not None and now >= straggle_at:
            job.stragglers = sorted(rank for pid, rank in job.workers.items() if rank not in job.exited)
            print(f"shardkit launch: rank(s) {job.stragglers} still running {straggle_s:g} s after rank(s) "
                  f"{sorted(job.exited)} exited (the collective timeout plus a grace): hung after the last "
                  f"collective; stopping the job", file=sys.stderr, flush=True)
            forwarded = True
            _stop(job, now + stop_grace)
        if job.kill_at is not None and now >= job.kill_at:
            _kill_everything(job)
        time.sleep(_POLL_S)
    return job.process.returncode


def _stop(job: _Job, kill_at: float) -> None:
    job.kill_at = kill_at
    try:
        job.process.send_signal(signal.SIGTERM)  # torchrun passes SIGTERM on to its ranks
    except ProcessLookupError:
        pass


def _kill_everything(job: _Job) -> None:
    """SIGKILL torchrun and the session of every rank it started (their own children die with them)."""
    _scan(job, time.monotonic())
    if job.process.poll() is None:
        job.process.kill()
        job.process.wait()
    for pid in job.workers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _scan(job: _Job, now: float) -> None:
    """Record torchrun's new children with their rank, and which ranks have exited."""
    alive = set()
    for pid in _children(job.process.pid):
        alive.add(pid)
        if pid not in job.workers:
            rank = _rank_of(pid)
            if rank is not None:
                job.workers[pid] = rank
        rss = rss_bytes(pid) if pid in job.workers else None
        if rss:
            job.rss[job.workers[pid]] = rss
    for pid, rank in job.workers.items():
        if pid not in alive and rank not in job.exited:
            job.exited[rank] = now
        if pid not in alive and rank not in job.signals:
            sig = exit_signal(pid)  # a zombie until torchrun reaps it (its monitor looks every 0.1 s)
            if sig is not None:
                job.signals[rank] = sig


def _children(parent: int) -> list[int]:
    """Live (not zombie) processes whose parent is `parent`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[0] != "Z" and int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            try:
                return int(item[5:])
            except ValueError:
                return None
    return None


def _killed(job: _Job, report_dir: str, code: int) -> str:
    """The OOM diagnosis of the first rank that died, when the job failed and a rank died of a signal or while the
    kernel's OOM-kill counters rose."""
    if code == 0 or not job.exited:
        return ""
    now = oom_kill_count()
    rose = now - job.oom_kills if now is not None and job.oom_kills is not None else 0
    for rank, sig in read_exit_signals(report_dir).items():  # ranks torchrun reaped before a scan saw them
        if rank in job.exited:
            job.signals.setdefault(rank, sig)
    # the first rank that died of a signal the launcher did not send itself (it stops the others with SIGTERM)
    first = min(job.exited, key=lambda rank: (rank not in job.signals, job.signals.get(rank) == signal.SIGTERM,
                                              job.exited[rank]))
    return describe_kill(first, job.signals.get(first), job.rss.get(first), rose, read_run_facts(report_dir))


def _fill(outcome: SupervisedOutcome, job: _Job, report_dir: str) -> None:
    if job.exited:
        outcome.first_exit = time.time() - (time.monotonic() - min(job.exited.values()))
    outcome.signals = {**job.signals, **read_exit_signals(report_dir)}
    reports = read_reports(report_dir)
    outcome.hung = sorted({rank for report in reports for rank in report.missing or ()} | set(job.stragglers))


def _summarise(job: _Job, report_dir: str, code: int) -> None:
    reports = read_reports(report_dir)
    killed = _killed(job, report_dir, code)
    if not reports and not job.stragglers and not killed:
        return
    lines = [f"shardkit launch: the job failed (exit code {code})"]
    if killed:
        lines.append(killed)
    hung = sorted({rank for report in reports for rank in report.missing or ()} | set(job.stragglers))
    if hung:
        lines.append(f"  root cause: rank(s) {hung} hung (did not arrive at a collective or outlived the others)")
    lines += [f"  {report.message}" for report in reports]
    print("\n".join(lines), file=sys.stderr, flush=True)
