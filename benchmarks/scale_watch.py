"""The guard around benchmarks/scale.py's runs, and its NVMe aio measurement.

A run is a child process (``scale.py --_trial cfg.json``) in its own session. From here its whole process
tree's memory (the sum of PSS; each process's peak RSS is reported too) and the bytes under its NVMe
directory are sampled twice a second; the tree is killed, and the run reported as "exceeded the memory
budget" (or the disk budget), as soon as either passes its budget or the machine's available memory runs
low. The run's directory is always removed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from shardkit.strategies.zero.config import libaio_available

__all__ = ["GIB", "Budget", "watched_run", "aio_tune", "disk_bytes_needed", "libaio_available"]

GIB = 2**30
# bf16 params (2) + fp32 master, Adam m and v (12) bytes per parameter on NVMe, and DeepSpeed's gradient swap
# (fp32, 4) on top: 18.0 measured at 0.4B parameters (1 rank).
NVME_BYTES_PER_PARAM = 18.0


@dataclass(frozen=True)
class Budget:
    """Limits of one run: a fraction of MemTotal for its process tree, a floor of MemAvailable, disk bytes."""

    mem_fraction: float = 0.75
    min_available: float = 1.5 * GIB
    disk_bytes: float = 60e9

    @property
    def mem_bytes(self) -> float:
        return self.mem_fraction * psutil.virtual_memory().total


def disk_bytes_needed(cfg: dict) -> float:
    """What a run may put under its NVMe directory (0 for strategies that use none)."""
    return NVME_BYTES_PER_PARAM * cfg["params"] + 1e9 if cfg["strategy"] == "zero_infinity" else 0.0


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _label(p: psutil.Process) -> str:
    try:
        rank = p.environ().get("RANK")
        trial = "--_trial" in " ".join(p.cmdline())  # the trial process: rank 0 itself when there is one rank
        role = "trial" if trial else (f"rank{rank}" if rank is not None else "proc")
    except (psutil.Error, OSError):
        role = "proc"
    return f"{role}:{p.pid}"


def _pss(p: psutil.Process) -> int:
    """Proportional set size: pages shared between processes split among them. The tree's budget sums PSS,
    not RSS: a process forked from a 12 GiB rank (a compiler probe, a subprocess) shows the parent's pages
    in its own RSS too, and summed RSS once read 22.8 GiB for a 12 GiB run."""
    try:
        with open(f"/proc/{p.pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return p.memory_info().rss


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512  # allocated, not apparent, size
            except OSError:
                pass
    return total


class _Watch:
    def __init__(self, budget: Budget, nvme: Path):
        self.budget, self.nvme = budget, nvme
        self.peak_tree, self.per_proc, self.peak_disk = 0, {}, 0
        self.error: str | None = None
        self._last_disk = 0.0

    def sample(self, proc: psutil.Process) -> None:
        total = 0
        for p in _tree(proc):
            try:
                rss, pss = p.memory_info().rss, _pss(p)
            except psutil.Error:
                continue
            total += pss
            key = _label(p)
            self.per_proc[key] = max(self.per_proc.get(key, 0), rss)
        self.peak_tree = max(self.peak_tree, total)
        if total > self.budget.mem_bytes:
            self.error = (f"exceeded the memory budget: process tree PSS {total / GIB:.2f} GiB > "
                          f"{self.budget.mem_bytes / GIB:.2f} GiB ({self.budget.mem_fraction:.0%} of RAM)")
        elif psutil.virtual_memory().available < self.budget.min_available:
            self.error = (f"exceeded the memory budget: the machine's available memory fell below "
                          f"{self.budget.min_available / GIB:.1f} GiB (tree RSS {total / GIB:.2f} GiB)")
        if time.monotonic() - self._last_disk > 2.0 and self.nvme.exists():
            self._last_disk = time.monotonic()
            self.peak_disk = max(self.peak_disk, _dir_bytes(self.nvme))
            if self.peak_disk > self.budget.disk_bytes:
                self.error = (f"exceeded the disk budget: {self.peak_disk / 1e9:.1f} GB > "
                              f"{self.budget.disk_bytes / 1e9:.0f} GB")


def _kill(child: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)  # the child leads its own session: this reaches its ranks, nothing else
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _check_disk(cfg: dict, budget: Budget, work_dir: Path) -> str | None:
    need = disk_bytes_needed(cfg)
    free = shutil.disk_usage(work_dir).free
    if need > budget.disk_bytes:
        return (f"refused: a {cfg['params'] / 1e9:.2f}B-parameter ZeROInfinity run needs about {need / 1e9:.0f} GB on "
                f"its NVMe path, over the disk budget of {budget.disk_bytes / 1e9:.0f} GB (--disk-budget-gb)")
    if need + 5e9 > free:
        return (f"refused: not enough free disk at {work_dir}: need about {need / 1e9:.0f} GB (+5 GB spare), "
                f"have {free / 1e9:.0f} GB; free space or point --work-dir at a larger disk")
    return None


def watched_run(cfg: dict, budget: Budget, work_dir: Path, script: Path) -> dict:
    """Run one trial of ``script`` under the budget; its figures plus ok/error, peak RSS and NVMe bytes."""
    work_dir.mkdir(parents=True, exist_ok=True)
    refused = _check_disk(cfg, budget, work_dir)
    if refused:
        return {"ok": False, "error": refused}
    run_dir = work_dir / f"run-{os.getpid()}-{time.time_ns()}"
    run_dir.mkdir()
    cfg = {**cfg, "nvme_path": str(run_dir / "nvme"), "result": str(run_dir / "result.json")}
    (run_dir / "cfg.json").write_text(json.dumps(cfg))
    watch = _Watch(budget, run_dir / "nvme")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(cfg["threads"]),
           "PYTHONWARNINGS": "ignore::FutureWarning",
           # glibc's per-thread arenas hold freed swap buffers as RSS; two arenas keep the peak near what is live
           "MALLOC_ARENA_MAX": "2"}  # torch's all_gather deprecation, once per collective
    if cfg.get("malloc_mmap_threshold"):
        # A fixed threshold turns off glibc's sliding one, which rises to 32 MiB after the first large free:
        # from then on every freed weight-sized block stays in the heap as RSS (measured at 0.8B on 2 ranks of
        # ZeROInfinity: peak 8.58 GiB with glibc's default, 4.01 GiB with 1 MiB).
        env["MALLOC_MMAP_THRESHOLD_"] = str(int(cfg["malloc_mmap_threshold"]))
    start, child = time.monotonic(), None
    try:
        child = subprocess.Popen([sys.executable, str(script), "--_trial", str(run_dir / "cfg.json")],
                                 start_new_session=True, env=env, cwd=script.parent)
        proc = psutil.Process(child.pid)
        while child.poll() is None:
            watch.sample(proc)
            if watch.error:
                _kill(child)
                break
            time.sleep(0.5)
        rc = child.wait()
        out = {"ok": False, "error": watch.error}
        if not watch.error and rc == 0 and (run_dir / "result.json").exists():
            out = {"ok": True, "error": None, **json.loads((run_dir / "result.json").read_text())}
        elif not watch.error:
            out["error"] = f"the run failed (exit status {rc}); its output is above"
    finally:  # also on SIGTERM/SIGINT here (main turns SIGTERM into SystemExit): no run outlives its watch
        if child is not None and child.poll() is None:
            _kill(child)
        shutil.rmtree(run_dir, ignore_errors=True)
    out.update({"peak_tree_rss": watch.peak_tree, "peak_rss_per_process": watch.per_proc,
                "mem_total": psutil.virtual_memory().total, "peak_disk_bytes": watch.peak_disk,
                "wall_s": time.monotonic() - start})
    return out


# ---- aio ----------------------------------------------------------------------------------------


def _rate(handle, buf, path: str) -> tuple[float, float]:
    start = time.perf_counter()
    handle.sync_pwrite(buf, path)
    os.sync()
    mid = time.perf_counter()
    handle.sync_pread(buf, path)
    end = time.perf_counter()
    n = buf.numel() * buf.element_size()
    return n / (mid - start) / 1e6, n / (end - mid) / 1e6


def aio_tune(work_dir: Path, size_mib: int = 512, repeats: int = 2) -> dict:
    """Write then read ``size_mib`` through DeepSpeed's aio handle over a grid; print MB/s and the best settings.

    O_DIRECT I/O (DeepSpeed's), so the page cache does not flatter the figures. The default settings
    are measured between the others, so their figure shares the same disk noise.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    work_dir.mkdir(parents=True, exist_ok=True)
    path = str(work_dir / f"aio-tune-{os.getpid()}.bin")
    buf = torch.empty(size_mib * 2**20, dtype=torch.uint8)
    buf.random_(0, 255)
    default = (1 << 20, 8, 1, False, True)

    def measure(setting) -> tuple[float, float]:
        bs, qd, th, single, overlap = setting
        handle = aio.aio_handle(bs, qd, single, overlap, th)
        best = (0.0, 0.0)
        for _ in range(repeats):
            w, r = _rate(handle, buf, path)
            best = (max(best[0], w), max(best[1], r))
        print(f"[aio] block {bs >> 10} KiB qd {qd} threads {th} single_submit {single} overlap {overlap}: "
              f"write {best[0]:.0f} MB/s read {best[1]:.0f} MB/s", flush=True)
        return best

    results: dict[tuple, tuple[float, float]] = {}
    defaults: list[float] = []  # every measurement of the defaults: their spread is the disk's noise
    score = lambda wr: 2 / (1 / wr[0] + 1 / wr[1])  # noqa: E731 (harmonic mean: a step both writes and reads)
    try:
        for bs in (1 << 18, 1 << 20, 1 << 22):
            for qd in (8, 32, 128):
                results[(bs, qd, 1, False, True)] = measure((bs, qd, 1, False, True))
            defaults.append(score(measure(default)))
        bs, qd = max(results, key=lambda k: score(results[k]))[:2]
        for th in (1, 2):
            for single in (False, True):
                for overlap in (True, False):
                    results[(bs, qd, th, single, overlap)] = measure((bs, qd, th, single, overlap))
        defaults.append(score(measure(default)))
    finally:
        if os.path.exists(path):
            os.remove(path)
    keys = ("block_size", "queue_depth", "thread_count", "single_submit", "overlap_events")
    best = max((k for k in results if k != default), key=lambda k: score(results[k]))
    gain = score(results[best]) / (sum(defaults) / len(defaults))
    beyond_noise = score(results[best]) > max(defaults)
    chosen = dict(zip(keys, best if beyond_noise else default))
    print(f"[aio] best other setting {dict(zip(keys, best))}: {score(results[best]):.0f} MB/s (harmonic mean of write "
          f"and read); DeepSpeed's defaults measured {len(defaults)} times: {min(defaults):.0f}-{max(defaults):.0f} "
          f"MB/s; gain x{gain:.2f} vs their mean, {'beyond' if beyond_noise else 'within'} their spread: "
          f"chosen {chosen}", flush=True)
    return {"chosen": chosen, "gain": gain}
