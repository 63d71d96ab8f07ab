"""Naming a rank that the kernel's out-of-memory killer ended, for `shardkit launch`'s summary.

A rank killed by the OOM killer dies of SIGKILL (exit -9, 137 in a shell) without a line of its own: torchrun only
says that it failed. The supervisor (``shardkit.distributed.supervise``) reads, while the job runs, each rank's
resident memory (``VmRSS``), a dead rank's exit status while it is a zombie (``/proc/<pid>/stat``'s ``exit_code``),
and the kernel's OOM-kill counters (``/proc/vmstat`` and the cgroup's ``memory.events``) before and after. Rank 0's
Runner leaves the run's size in the report folder at ``setup()`` (:func:`write_run_facts`), from which the summary
gives the ``shardkit estimate-memory`` command for this run.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

__all__ = ["describe_kill", "exit_signal", "leave_run_facts", "oom_kill_count", "read_exit_signals", "read_run_facts",
           "rss_bytes", "write_exit_signals", "write_run_facts"]

RUN_FACTS = "run-facts.json"
EXIT_SIGNALS = "exit-signals.json"
_MAX_FACTS_BYTES = 4096


def write_run_facts(folder: str | os.PathLike, params: int, precision: str, nproc_per_node: int, nodes: int) -> None:
    """Rank 0: the run's size for the launcher's out-of-memory message (nothing if the folder is gone)."""
    try:
        Path(folder, RUN_FACTS).write_text(json.dumps({"params": int(params), "precision": str(precision),
                                                       "nproc_per_node": int(nproc_per_node), "nodes": int(nodes)}))
    except OSError:
        pass


def leave_run_facts(model: Any, precision: str) -> None:
    """Under `shardkit launch` (its report folder in the environment): :func:`write_run_facts` for ``model``
    trained in ``precision`` ("bf16", "fp16", "fp32")."""
    from shardkit.distributed.watchdog import REPORT_DIR_ENV

    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    params = sum(p.numel() for p in model.parameters())
    write_run_facts(folder, params, precision, local, max(1, world // max(local, 1)))


def _small_json(path: Path) -> Any:
    """A small regular file's JSON (a launcher's own note, still read as hostile input); None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            raw = f.read(_MAX_FACTS_BYTES + 1)
        return None if len(raw) > _MAX_FACTS_BYTES else json.loads(raw)
    except (OSError, ValueError, RecursionError):  # RecursionError: "[[[[..." nests past the parser's depth
        return None


def read_run_facts(folder: str | os.PathLike) -> dict[str, Any] | None:
    """What :func:`write_run_facts` left, checked (a regular file, small, the four keys in range); else None."""
    data = _small_json(Path(folder, RUN_FACTS))
    try:
        facts = {"params": int(data["params"]), "precision": str(data["precision"]),
                 "nproc_per_node": int(data["nproc_per_node"]), "nodes": int(data["nodes"])}
    except (ValueError, KeyError, TypeError):
        return None
    ok = facts["params"] > 0 and facts["nproc_per_node"] > 0 and facts["nodes"] > 0
    return facts if ok and facts["precision"].replace("-", "").isalnum() else None


def write_exit_signals(folder: str | os.PathLike, signals: dict[int, int]) -> None:
    """torchrun's wrapper: the signal that ended each failed rank, for the supervisor's diagnosis. The supervisor
    sees a dead rank's status only while it is a zombie, and torchrun may reap it first (seen with a real OOM
    kill: "vanished without an error")."""
    try:
        Path(folder, EXIT_SIGNALS).write_text(json.dumps({str(int(r)): int(s) for r, s in signals.items()}))
    except OSError:
        pass


def read_exit_signals(folder: str | os.PathLike) -> dict[int, int]:
    """What :func:`write_exit_signals` left: rank -> signal number, entries out of range dropped."""
    data = _small_json(Path(folder, EXIT_SIGNALS))
    found: dict[int, int] = {}
    for rank, sig in (data.items() if isinstance(data, dict) else ()):
        if isinstance(rank, str) and rank.isascii() and rank.isdigit() and type(sig) is int and 0 < sig < 65:
            found[int(rank)] = sig
    return found


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` (``VmRSS``), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def exit_signal(pid: int) -> int | None:
    """The signal that ended ``pid`` while it is a zombie not yet reaped by its parent; None otherwise."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # field 3 (state) is fields[0]; field 52 (exit_code) is fields[49]
    if len(fields) < 50 or fields[0] != "Z":
        return None
    status = int(fields[49])
    return status & 0x7F or None


def oom_kill_count() -> int | None:
    """The kernel's OOM kills so far: system-wide (``/proc/vmstat``) plus this cgroup's (``memory.events``)."""
    total, found = 0, False
    sources = [(Path("/proc/vmstat"), "oom_kill")]
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
        sources.append((Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.events", "oom_kill"))
    except (OSError, StopIteration):
        pass
    for path, key in sources:
        try:
            for row in path.read_text().splitlines():
                name, _, value = row.partition(" ")
                if name == key:
                    total, found = total + int(value), True
        except (OSError, ValueError):
            continue
    return total if found else None


def describe_kill(rank: int, sig: int | None, rss: int | None, oom_kills: int, facts: dict[str, Any] | None) -> str:
    """The summary's lines for a rank that died of a signal or while the OOM counters rose; "" when neither."""
    if sig is None and oom_kills <= 0:
        return ""
    seen = f"{rss / 2**30:.2f} GiB resident when last seen" if rss else "its memory was not seen"
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        how = f"rank {rank} was killed by {name} (exit {-sig}, {128 + sig} in a shell), {seen}"
    else:
        how = f"rank {rank} vanished without an error, {seen}"
    if oom_kills > 0:
        cause = f"the kernel's out-of-memory killer ended it ({oom_kills} OOM kill(s) counted during the job)"
    elif sig == signal.SIGKILL:
        cause = ("SIGKILL from outside: the kernel's out-of-memory killer is the usual sender (a container's limit "
                 "may not show in this machine's counters); `dmesg | grep -i oom` tells")
    else:
        return f"  {how}"
    lines = [f"  {how}: {cause}.", "  what fits: " + _estimate_command(facts)]
    return "\n".join(lines)


def _estimate_command(facts: dict[str, Any] | None) -> str:
    if facts is None:
        return "shardkit estimate-memory --params <model parameters> --num-gpus <ranks per node> (every strategy)"
    return (f"shardkit estimate-memory --params {facts['params']} --num-gpus {facts['nproc_per_node']} "
            f"--num-nodes {facts['nodes']} --precision {facts['precision']} (every strategy; add --batch-size and "
            "--seq-len for activations); a strategy that shards or offloads more, or a smaller micro-batch, fits "
            "in less host memory")
