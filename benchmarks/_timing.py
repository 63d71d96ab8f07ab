"""Shared timing and peak-memory helpers for the benchmark scripts (device-agnostic: CPU or CUDA).

Time: ``median_time(fn, warmup, repeats)`` synchronises CUDA around each call and returns the median in seconds.

Peak memory: ``peak_memory(fn)`` returns the bytes a call adds at its peak over what was live before it.
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the caching allocator's view).
- CPU: the process's peak resident set (``VmHWM`` in /proc/self/status), reset before the call by writing 5
  to /proc/self/clear_refs (Linux >= 4.0), minus the resident set before it. This counts every byte the call
  touches, also buffers allocated inside C++ extensions outside torch's allocator. It needs large blocks to go
  back to the OS when freed, otherwise a later call reuses pages that already count as resident: call
  :func:`ensure_malloc_returns_memory` first thing, which re-executes the script with glibc's mmap threshold
  fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_``; fixing it also turns off glibc's dynamic raising of it).
  Precision: a few MiB (page granularity, small heap blocks, the interpreter's own allocations).
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "status_bytes",
    "child_wall_and_peak",
    "ensure_malloc_returns_memory",
    "fmt_bytes",
    "machine_description",
    "median_time",
    "peak_memory",
    "print_table",
    "sync",
]

_MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def ensure_malloc_returns_memory() -> None:
    """Re-exec this process once with ``MALLOC_MMAP_THRESHOLD_=1048576`` so CPU peak memory is measurable."""
    if sys.platform.startswith("linux") and _MMAP_ENV not in os.environ:
        os.environ[_MMAP_ENV] = str(1 << 20)
        os.execv(sys.executable, [sys.executable, *sys.argv])


def sync(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], warmup: int = 1, repeats: int = 5,
                device: torch.device | str = "cpu", warmup_s: float = 0.0) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` calls after ``warmup`` calls.

    ``warmup_s``: keep warming up until that many seconds have passed as well. On CPU the first calls that
    fault in fresh huge pages run several times slower (the kernel assembles 2 MiB pages) until freed ones
    are being reused; a training loop only sees the steady state, so that is what is timed.
    """
    start = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - start < warmup_s:
        fn()
        done += 1
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ranks_timed(step: Callable[[], object], steps: int) -> float:
    """Seconds per call of ``step`` over ``steps`` calls, fenced by barriers so every rank times the same work."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``, ...) in bytes."""
    return _status_kib(field) * 1024


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu",
                setup: Callable[[], object] | None = None) -> int | None:
    """Bytes ``fn()`` adds at its peak over what was allocated before it; None where it cannot be measured.

    ``setup()`` runs before the baseline is read: free there what ``fn`` would otherwise free inside the
    measured window (e.g. the ``.grad`` of the previous call, which ``fn`` replaces), or the peak comes out low
    by that much.
    """
    if setup is not None:
        setup()
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - before) * 1024
    except OSError:
        return None


def fmt_bytes(n: int | float | None) -> str:
    """``1.5 GiB`` style; ``n/a`` for None."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def machine_description(device: torch.device | str = "cpu") -> str:
    """CPU model and core count (and the GPU name when ``device`` is CUDA), torch version."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{model}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    if torch.device(device).type == "cuda":
        desc += f", GPU {torch.cuda.get_device_name()}"
    return desc


def print_table(headers: list[str], rows: list[list[str]]) -> str:
    """Print and return a Markdown table."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines = ["| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |" for r in [headers] + rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def child_wall_and_peak(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, peak RSS bytes) of one child process running ``cmd``; its stderr is shown if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024
