"""Naming the rank that did not arrive when a collective times out.

A timed-out collective says only that *this* rank waited: gloo's message is "Timed out waiting 6000ms for
recv operation", on every rank that arrived. To name the rank that did not, every rank whose collective
times out writes a mark into the job's rendezvous store (a separate TCP connection that still works while
the collective is stuck), waits a short while for its peers' marks, and names the ranks that left none:
they are alive (a dead rank's sockets close and its peers fail at once with "Connection reset by peer")
but never entered the collective.

Where the explanation goes:
    * `explain()` returns it for a caught exception (`launch()`'s rank processes send it to the parent);
    * `install_excepthook()` (called by `init_distributed`) prints it for a script that dies of a timeout
      under `shardkit launch`, and writes it to $SHARDKIT_REPORT_DIR for the launcher's summary;
    * `destroy_distributed` raises `CollectiveTimeoutError` with it when the final barrier times out.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from shardkit.distributed.timeouts import default_timeout

__all__ = ["CollectiveTimeoutError", "REPORT_DIR_ENV", "TimeoutReport", "explain", "install_excepthook",
           "is_collective_timeout", "missing_ranks", "read_reports"]

REPORT_DIR_ENV = "SHARDKIT_REPORT_DIR"
_KEY = "shardkit/collective_timeout/"
# gloo: "Timed out waiting 6000ms for recv operation"; NCCL's watchdog: "Watchdog caught collective operation
# timeout". Narrow on purpose: a diagnosis waits for peers, so an unrelated "timeout" must not trigger one.
_TIMEOUT_TEXT = re.compile(r"timed out waiting \d+ ?ms|collective operation timeout", re.IGNORECASE)
# Peers that arrived late start their own clock late and so time out late; wait this long for their marks.
# Half the timeout (a peer later than that was itself close to timing out), between 2 and 10 seconds.
_MIN_WAIT_S, _MAX_WAIT_S = 2.0, 10.0
_PEER_LOST_TEXT = re.compile(r"Connection (closed|reset) by peer", re.IGNORECASE)
_state: dict[str, float | None] = {"timeout_s": None}  # the timeout init_distributed gave the group


class CollectiveTimeoutError(RuntimeError):
    """A collective waited its whole timeout; `missing` names the ranks that never entered it."""

    def __init__(self, message: str, missing: list[int] | None = None):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class TimeoutReport:
    """What one rank learned when its collective timed out."""

    rank: int
    missing: list[int] | None
    message: str


def is_collective_timeout(err: BaseException) -> bool:
    """True for the error a collective raises when it waited its whole timeout (gloo, NCCL, the store)."""
    if isinstance(err, CollectiveTimeoutError):
        return True
    return isinstance(err, RuntimeError) and bool(_TIMEOUT_TEXT.search(str(err)))


def missing_ranks(wait_s: float | None = None) -> list[int] | None:
    """Mark this rank as timed out in the store, wait for the peers' marks; the ranks that left none.

    Returns None when there is no process group or the store cannot be reached (the rank hosting it died).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if wait_s is None:
        wait_s = min(_MAX_WAIT_S, max(_MIN_WAIT_S, _group_timeout_s() / 2))
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_KEY}{rank}", str(time.time()))
        deadline = time.monotonic() + wait_s
        while True:
            arrived = {r for r in range(world) if store.check([f"{_KEY}{r}"])}
            if len(arrived) == world or time.monotonic() >= deadline:
                return sorted(set(range(world)) - arrived)
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - a diagnosis must never replace the error it explains
        return None


def _group_timeout_s() -> float:
    if _state["timeout_s"] is not None:
        return _state["timeout_s"]
    try:
        return default_timeout()
    except ValueError:
        return 2 * _MIN_WAIT_S


def describe(rank: int, missing: list[int] | None, what: str = "a collective") -> str:
    """One line naming the ranks that did not arrive (or saying that they could not be found out)."""
    seconds = f"{_group_timeout_s():g} s"
    if missing is None:
        return (f"rank {rank}: {what} timed out after {seconds}; the ranks that did not arrive could not be "
                f"found out (the rendezvous store is gone)")
    if not missing:
        return (f"rank {rank}: {what} timed out after {seconds}, though every rank reached a collective: they "
                f"called different collectives (a rank-dependent branch around a collective?)")
    names = ", ".join(map(str, missing))
    return (f"rank {rank}: {what} timed out after {seconds} waiting for rank {names}, which did not arrive "
            f"(alive but hung or far behind; see {'its' if len(missing) == 1 else 'their'} stack, e.g. with "
            f"py-spy dump)")


def explain(err: BaseException) -> TimeoutReport | None:
    """For a collective timeout raised on this rank: which ranks did not arrive, as a report; else None."""
    if not is_collective_timeout(err) or not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    missing = err.missing if isinstance(err, CollectiveTimeoutError) else missing_ranks()
    message = str(err) if isinstance(err, CollectiveTimeoutError) else describe(rank, missing)
    report = TimeoutReport(rank, missing, message)
    _write_report(report)
    return report


def _write_report(report: TimeoutReport) -> None:
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    try:
        path = Path(folder, f"rank-{report.rank}.json")
        path.write_text(json.dumps({"rank": report.rank, "missing": report.missing, "message": report.message}))
    except OSError:
        pass  # the launcher's summary loses one line; the rank's own stderr still has it


def read_reports(folder: str | os.PathLike) -> list[TimeoutReport]:
    """The reports ranks wrote into `folder`, by rank; malformed files are skipped."""
    reports = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
            missing = data["missing"]
            if missing is not None:
                missing = [int(r) for r in missing]
            reports.append(TimeoutReport(int(data["rank"]), missing, str(data["message"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(reports, key=lambda r: r.rank)


def install_excepthook(timeout_s: float | None = None) -> None:
    """Explain a collective timeout that ends the script (once per process; chains the previous hook).

    Args:
        timeout_s: the process group's collective timeout, quoted in the explanation.
    """
    _state["timeout_s"] = timeout_s
    previous = sys.excepthook
    if getattr(previous, "_shardkit", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        report = explain(value) if isinstance(value, BaseException) else None
        if report is not None and not isinstance(value, CollectiveTimeoutError):
            print(f"shardkit: {report.message}", file=sys.stderr, flush=True)
        elif isinstance(value, RuntimeError) and _PEER_LOST_TEXT.search(str(value)) and dist.is_initialized():
            print(f"shardkit: rank {dist.get_rank()}: a peer closed its connection during a collective: that rank "
                  f"died (its own error says why; on another machine, see that machine's launcher, or the machine "
                  f"itself went down)", file=sys.stderr, flush=True)

    hook._shardkit = True  # type: ignore[attr-defined]
    sys.excepthook = hook
