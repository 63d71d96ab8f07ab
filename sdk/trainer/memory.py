"""Memory metrics (``skip_memory_metrics=False``): what each stage of the Trainer allocated, as Hugging Face names them.

Stages are ``init`` (building the Trainer), ``train``, ``eval`` and ``test`` (``predict``). For each,
``<stage>_mem_cpu_alloc_delta`` is the change of this process's resident memory over the stage and
``<stage>_mem_cpu_peaked_delta`` how far above its end value it peaked (sampled every 10 ms by a thread);
on CUDA the same from torch's allocator as ``<stage>_mem_gpu_*``. Bytes, as integers.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

__all__ = ["MemoryTracker"]


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except ImportError:  # Linux without psutil: pages from /proc
        with open(f"/proc/{os.getpid()}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryTracker:
    """Measures each stage between :meth:`start` and :meth:`stop`; does nothing when ``skip`` is True.

    Args:
        skip: ``TrainingArguments.skip_memory_metrics``.
    """

    def __init__(self, skip: bool):
        self.skip = skip
        self._stage: str | None = None
        self._begin, self._peak = 0, 0
        self._gpu_begin = 0
        self._running = False
        self._thread: threading.Thread | None = None
        self.metrics: dict[str, dict[str, int]] = {}

    def start(self, stage: str) -> None:
        """Begin measuring ``stage`` (a stage already being measured, e.g. eval inside train, is left alone)."""
        if self.skip or self._stage is not None:
            return
        self._stage = stage
        self._begin = self._peak = _rss()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._gpu_begin = torch.cuda.memory_allocated()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        event = threading.Event()
        while self._running:
            self._peak = max(self._peak, _rss())
            event.wait(0.01)

    def stop(self, stage: str) -> None:
        """End ``stage`` and keep its numbers for :meth:`update_metrics`."""
        if self.skip or self._stage != stage:
            return
        self._running = False
        if self._thread is not None:
            self._thread.join()
        end = _rss()
        numbers = {"cpu_alloc_delta": end - self._begin, "cpu_peaked_delta": max(0, self._peak - end)}
        if torch.cuda.is_available():
            gpu_end = torch.cuda.memory_allocated()
            numbers.update(gpu_alloc_delta=gpu_end - self._gpu_begin,
                           gpu_peaked_delta=max(0, torch.cuda.max_memory_allocated() - gpu_end))
        self.metrics[stage] = numbers
        self._stage = None

    def update_metrics(self, stage: str, metrics: dict[str, Any]) -> None:
        """Add ``<stage>_mem_*`` (and ``init_mem_*`` once, with the first train metrics) to ``metrics``."""
        if self.skip:
            return
        stages = [stage] + (["init"] if stage == "train" and "init" in self.metrics else [])
        for name in stages:
            for key, value in self.metrics.get(name, {}).items():
                metrics[f"{name}_mem_{key}"] = value
