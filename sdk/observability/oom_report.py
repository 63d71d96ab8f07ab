"""What a run leaves behind when it runs out of memory: the last steps, the memory it held, and what fits.

An out-of-memory error ends a training script with a line that says only how many bytes one allocation wanted. The
Runner keeps a small flight recorder (:class:`StepRecorder`: the last optimizer steps with their time, loss and the
memory held after each) and, when an out-of-memory error passes through ``backward``/``step`` or ends the script
(:func:`install_oom_excepthook`), writes ``oom_report.rank<N>.json`` into its ``logging_dir``:

* ``error`` and ``failing_allocation_bytes`` (parsed from the message, or the CUDA allocator's own figure);
* ``memory``: the host's resident/peak/limit bytes and, on CUDA, allocated/reserved/peak/free and torch's
  ``memory_summary()`` table;
* ``last_steps``: the flight recorder's rows;
* ``fix``: the ``shardkit estimate-memory`` command for this run and the levers that lower memory;
* ``snapshot``: the CUDA memory snapshot written by :func:`~shardkit.observability.install_oom_snapshot`, if any.

Handled: CUDA's ``torch.OutOfMemoryError``, Python's ``MemoryError`` and the CPU allocator's ``RuntimeError``
("DefaultCPUAllocator: can't allocate memory").
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import resource
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepRecorder", "failing_allocation", "install_oom_excepthook", "is_out_of_memory", "memory_summary",
           "note_cuda_oom", "write_oom_report"]

log = logging.getLogger("shardkit.observability")
_CPU_TEXT = re.compile(r"(?:can't|cannot) allocate memory|not enough memory", re.IGNORECASE)
_BYTES_TEXT = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)
_UNIT_TEXT = re.compile(r"tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)", re.IGNORECASE)
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_last_cuda_oom: dict[str, Any] = {}  # the CUDA allocator's figures at its last out-of-memory (note_cuda_oom)
_hook: dict[str, Any] = {"installed": False, "report": None}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _is_device_oom(exc: BaseException) -> bool:
    return isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA's OutOfMemoryError, Python's MemoryError and the CPU allocator's failure."""
    if isinstance(exc, MemoryError) or _is_device_oom(exc):
        return True
    return isinstance(exc, RuntimeError) and bool(_CPU_TEXT.search(str(exc)[:2000]))


def failing_allocation(exc: BaseException) -> int | None:
    """The bytes the failing allocation asked for: the CPU allocator's exact count, the CUDA allocator's own figure
    when its observer saw the error, else CUDA's rounded "2.00 GiB"; None for Python's MemoryError."""
    text = str(exc)[:2000]
    if (exact := _BYTES_TEXT.search(text)) is not None:
        return int(exact.group(1))
    if _is_device_oom(exc) and _last_cuda_oom.get("alloc"):
        return int(_last_cuda_oom["alloc"])
    if (rounded := _UNIT_TEXT.search(text)) is not None:
        return int(float(rounded.group(1)) * _UNITS[rounded.group(2).lower()])
    return None


def note_cuda_oom(device: int, alloc: int, allocated: int, free: int) -> None:
    """Keep the CUDA allocator's figures of an out-of-memory (called from its observer) for the report."""
    _last_cuda_oom.update(device=device, alloc=alloc, allocated=allocated, free=free)


class StepRecorder:
    """The flight recorder: the last ``size`` optimizer steps (time, seconds taken, loss, memory held after it)."""

    def __init__(self, size: int = 20) -> None:
        self.rows: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self._loss: torch.Tensor | None = None
        self._last = time.monotonic()

    def on_backward(self, loss: torch.Tensor) -> None:
        """Keep the micro-batch's loss (detached; read only when a report is written, so no sync per step)."""
        self._loss = loss.detach()

    def on_step(self, step: int) -> None:
        """Record optimizer step ``step`` as ended now."""
        now = time.monotonic()
        row: dict[str, Any] = {"step": step, "time": time.time(), "seconds": round(now - self._last, 6),
                               "loss": self._loss, "host_rss_bytes": _rss_bytes()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            row["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
            row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        self.rows.append(row)
        self._last, self._loss = now, None

    def as_list(self) -> list[dict[str, Any]]:
        """The rows, losses as floats (None where it cannot be read)."""
        return [{**row, "loss": _float(row["loss"])} for row in self.rows]


def _float(value: torch.Tensor | None) -> float | None:
    try:
        return None if value is None else float(value.float().mean())
    except Exception:  # noqa: BLE001 - a loss on a device that is itself failing must not stop the report
        return None


def _rss_bytes() -> int | None:
    """Resident bytes from /proc/self/statm: 120 us per read against /proc/self/status's 360 us (measured on the
    shared 2-core machine at load 11), once per optimizer step."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _proc_status() -> dict[str, int]:
    """VmRSS, VmHWM (peak resident), VmSize, VmPeak of this process in bytes (empty off Linux)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "VmSize", "VmPeak"):
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def memory_summary() -> dict[str, Any]:
    """The memory this process holds: host (resident, peak, address-space limit) and, on CUDA, the allocator's."""
    status = _proc_status()
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    host = {"rss_bytes": status.get("VmRSS"), "peak_rss_bytes": status.get("VmHWM"),
            "virtual_bytes": status.get("VmSize"), "peak_virtual_bytes": status.get("VmPeak"),
            "address_space_limit_bytes": None if limit == resource.RLIM_INFINITY else limit}
    summary: dict[str, Any] = {"host": host}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        summary["cuda"] = {"device": torch.cuda.current_device(), "allocated_bytes": torch.cuda.memory_allocated(),
                           "reserved_bytes": torch.cuda.memory_reserved(),
                           "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "free_bytes": free,
                           "total_bytes": total, "table": torch.cuda.memory_summary(abbreviated=True)}
    return summary


def _fix(facts: dict[str, Any] | None, allocation: int | None, summary: dict[str, Any]) -> str:
    where = "GPU" if "cuda" in summary else "host"
    asked = f"{allocation / 2**20:.1f} MiB" if allocation else "an allocation of unknown size"
    if facts is None:
        command = "shardkit estimate-memory --params <model parameters> --num-gpus <ranks per node>"
    else:
        command = (f"shardkit estimate-memory --params {facts['params']} --num-gpus {facts['nproc_per_node']} "
                   f"--num-nodes {facts['nodes']} --precision {facts['precision']}")
    return (f"the {where} ran out of memory asking for {asked}. What fits: `{command}` (every strategy; add "
            "--batch-size and --seq-len for activations). Then: a strategy that shards or offloads more (fsdp, zero3, "
            "zero3 with offload), activation_checkpointing=True, or a smaller micro-batch with more "
            "gradient_accumulation_steps")


def write_oom_report(exc: BaseException, folder: str | Path, rank: int, recorder: StepRecorder | None = None,
                     facts: dict[str, Any] | None = None, snapshot: str | Path | None = None) -> Path:
    """Write ``<folder>/oom_report.rank<rank>.json`` for ``exc`` and log where it is, with the fix.

    Args:
        exc: the out-of-memory error.
        folder: where the report goes (the Runner's ``logging_dir``).
        rank: this process's rank (in the file name).
        recorder: the flight recorder whose last steps go in the report.
        facts: the run's size for the ``estimate-memory`` command (``params``, ``precision``,
            ``nproc_per_node``, ``nodes``).
        snapshot: the CUDA memory snapshot's path, named when it exists.
    """
    allocation = failing_allocation(exc)
    summary = memory_summary()
    snap = Path(snapshot) if snapshot is not None and Path(snapshot).is_file() else None
    report = {"error": {"type": type(exc).__name__, "message": str(exc)[:2000]},
              "failing_allocation_bytes": allocation,
              "cuda_allocator": dict(_last_cuda_oom) if _is_device_oom(exc) and _last_cuda_oom else None,
              "memory": summary, "last_steps": recorder.as_list() if recorder is not None else [],
              "fix": _fix(facts, allocation, summary), "snapshot": None if snap is None else str(snap)}
    path = Path(folder) / f"oom_report.rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    _last_cuda_oom.clear()  # this error's figures; the next out-of-memory brings its own
    log.error("out of memory on rank %d: report (last %d steps, memory summary) written to %s%s; %s", rank,
              len(report["last_steps"]), path, f", CUDA memory snapshot {snap}" if snap else "", report["fix"])
    return path


def install_oom_excepthook(report: Callable[[BaseException], Path | None]) -> None:
    """Make ``report(exc)`` run for an out-of-memory error that ends the script (the latest Runner's; the hook
    is installed once per process, chains the previous one and holds ``report``'s object by weak reference)."""
    owner = getattr(report, "__self__", None)
    _hook["report"] = weakref.WeakMethod(report) if owner is not None else (lambda: report)
    if _hook["installed"]:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        reporter = _hook["report"]() if _hook["report"] is not None else None
        if reporter is not None and is_out_of_memory(exc) and not getattr(exc, "_shardkit_oom_report", None):
            try:
                reporter(exc)
            except Exception as err:  # noqa: BLE001 - the original error must still be printed
                log.error("the out-of-memory report could not be written: %s", err)
        previous(kind, exc, tb)

    sys.excepthook = hook
    _hook["installed"] = True
