"""``profile_steps``: torch.profiler over chosen optimizer steps, and a CUDA memory snapshot on out-of-memory.

:class:`StepProfiler` starts ``torch.profiler`` when the chosen range of optimizer steps begins and stops it when it
ends, then writes, per rank, ``trace.rank<N>.json`` (Chrome trace: chrome://tracing or https://ui.perfetto.dev),
``memory_timeline.rank<N>.json`` (the profiler's memory timeline: bytes per category over time) and
``top_ops.rank<N>.txt``, and logs the top-ops table on the main process.

:func:`install_oom_snapshot` records the CUDA allocator's history and attaches an observer that writes
``oom_snapshot.rank<N>.pickle`` (open it at https://pytorch.org/memory_viz) when an allocation fails, before the
``OutOfMemoryError`` reaches the training loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardkit.observability.oom_report import note_cuda_oom

__all__ = ["StepProfiler", "install_oom_snapshot", "oom_observer", "parse_profile_steps"]

log = logging.getLogger("shardkit.observability")
_snapshot: dict[str, Callable[..., None] | None] = {"current": None}  # the observer the allocator's one calls
_TOP_OPS = 15


def parse_profile_steps(value: Any) -> range:
    """``profile_steps`` as a range of optimizer steps: ``(start, stop)`` (stop excluded), ``"3-5"`` (both
    included), or ``n`` (the one step ``n``). Steps count from 0 (the first optimizer step of the run).

    Raises:
        ValueError: a value of another form, or an empty or negative range.
    """
    try:
        if isinstance(value, int) and not isinstance(value, bool):
            start, stop = value, value + 1
        elif isinstance(value, str) and "-" in value:
            first, last = value.split("-", 1)
            start, stop = int(first), int(last) + 1
        elif isinstance(value, str):
            start = int(value)
            stop = start + 1
        elif isinstance(value, (tuple, list, range)) and len(value) == 2 and not isinstance(value, range):
            start, stop = int(value[0]), int(value[1])
        elif isinstance(value, range) and value.step == 1:
            start, stop = value.start, value.stop
        else:
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"profile_steps={value!r:.60} is not a step range: give (start, stop) with stop excluded, "
                         "'3-5' with both included, or one step number, e.g. profile_steps=(2, 4)") from None
    if start < 0 or stop <= start:
        raise ValueError(f"profile_steps={value!r:.60} is empty or negative: steps count from 0, e.g. (2, 4)")
    return range(start, stop)


class StepProfiler:
    """Profiles a range of optimizer steps of one rank.

    Args:
        steps: the steps to record (see :func:`parse_profile_steps`).
        output_dir: where the trace, memory timeline and top-ops table go.
        rank: this process's rank (in the file names).
        is_main_process: logs the top-ops table.
    """

    def __init__(self, steps: Any, output_dir: str | Path, rank: int = 0, is_main_process: bool = True) -> None:
        self.steps = parse_profile_steps(steps)
        self.output_dir, self.rank, self.is_main_process = Path(output_dir), rank, is_main_process
        self.profile: torch.profiler.profile | None = None
        self.files: list[Path] = []
        self.table = ""

    def before_step(self, step: int) -> None:
        """Called when optimizer step ``step`` begins (after the previous one ended)."""
        if step == self.steps.start and self.profile is None and not self.files:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # record_shapes and with_stack are what the memory timeline needs to put bytes in categories.
            self.profile = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True,
                                                  with_stack=True)
            self.profile.start()

    def after_step(self, step: int) -> None:
        """Called when optimizer step ``step`` has ended."""
        if self.profile is not None and step + 1 >= self.steps.stop:
            self.finish()

    def finish(self) -> None:
        """Stop a recording in progress and write its files (a loop that ends inside the range still gets them)."""
        if self.profile is None:
            return
        profile, self.profile = self.profile, None
        profile.stop()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        trace = self.output_dir / f"trace.rank{self.rank}.json"
        profile.export_chrome_trace(str(trace))
        memory = self.output_dir / f"memory_timeline.rank{self.rank}.json"
        _memory_timeline(profile, memory)
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        self.table = _top_ops(profile, sort)
        top = self.output_dir / f"top_ops.rank{self.rank}.txt"
        top.write_text(self.table)
        self.files = [trace, memory, top]
        if self.is_main_process:
            log.warning("profile of optimizer steps %d-%d written to %s (trace, memory timeline); top ops:\n%s",
                        self.steps.start, self.steps.stop - 1, self.output_dir, self.table)


def _memory_timeline(profile: torch.profiler.profile, path: Path) -> None:
    """torch's memory timeline (bytes per category over time) or, where its categorisation fails on a graph (an
    AssertionError inside torch.profiler._memory_profiler on some models), the allocated bytes after each operator
    from the same recording: ``{"times_us": [...], "bytes": [...]}``."""
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    try:
        profile.export_memory_timeline(str(path), device=device)
        return
    except (AssertionError, RuntimeError, KeyError) as err:
        log.warning("torch's memory timeline failed (%s: %.200s); writing allocated bytes per operator to %s "
                    "instead", type(err).__name__, err, path)
    events = sorted(profile.events(), key=lambda e: e.time_range.start)
    field = "device_memory_usage" if device != "cpu" else "cpu_memory_usage"
    times, total, allocated = [], 0, []
    for event in events:
        change = getattr(event, field, 0) or 0
        if change:
            total += change
            times.append(event.time_range.start)
            allocated.append(total)
    path.write_text(json.dumps({"device": device, "times_us": times, "bytes": allocated}))


def _top_ops(profile: torch.profiler.profile, sort: str) -> str:
    """The table of operators, without the Python frames that ``with_stack`` adds to the events."""
    from torch.autograd.profiler_util import EventList

    ops = [e for e in profile.key_averages() if ".py(" not in e.key and not e.key.startswith("<built-in")]
    return EventList(ops).table(sort_by=sort, row_limit=_TOP_OPS)


def install_oom_snapshot(output_dir: str | Path, rank: int = 0, *, max_entries: int = 100_000) -> Callable | None:
    """On CUDA: record the allocator's history and write a memory snapshot when an allocation fails.

    Returns:
        The observer attached (call it to write the snapshot by hand), or None without CUDA.
    """
    if not torch.cuda.is_available():
        return None
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    observer = oom_observer(output_dir, rank)
    # The allocator keeps every observer attached, for the process's life: attach one that calls the latest
    # Runner's, so that a second Runner in the process does not write a second snapshot per out-of-memory.
    if _snapshot["current"] is None:
        torch._C._cuda_attach_out_of_memory_observer(lambda *args: _snapshot["current"](*args))
    _snapshot["current"] = observer
    return observer


def oom_observer(output_dir: str | Path, rank: int) -> Callable[..., None]:
    """The function the CUDA allocator calls on an out-of-memory error: writes the snapshot and says where."""
    path = Path(output_dir) / f"oom_snapshot.rank{rank}.pickle"

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        note_cuda_oom(device, alloc, device_allocated, device_free)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            log.error("CUDA out of memory on device %d asking for %d bytes (%d allocated, %d free): memory snapshot "
                      "written to %s; open it at https://pytorch.org/memory_viz", device, alloc, device_allocated,
                      device_free, path)
        except Exception as err:  # noqa: BLE001 - the OOM error itself must still reach the loop
            log.error("CUDA out of memory; the memory snapshot could not be written to %s: %s", path, err)

    return observer
