"""Runs zero-to-fp32 on pickle-bomb checkpoints under hard limits: ``python probe_bombs.py ROOT OUT CASE...``.

Address space is capped at what the process holds after importing torch plus 1 GiB (RLIMIT_AS), and files it
writes at 64 MiB (RLIMIT_FSIZE), so a regression raises MemoryError or EFBIG instead of taking the machine.
Prints one JSON line per case, ``{"case", "error", "message", "seconds", "peak_rss_mb"}``, as each one ends.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from shardkit.checkpoint import consolidate_deepspeed


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(root: Path, out: Path, cases: list[str]) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + (1 << 30),) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20,) * 2)
    for case in cases:
        t0 = time.monotonic()
        try:
            consolidate_deepspeed(root / case, out / case)
            error, message = None, "converted without an error"
        except Exception as e:  # noqa: BLE001 - the probe reports whatever comes out, bare errors included
            error, message = type(e).__name__, str(e)[:2000]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(json.dumps({"case": case, "error": error, "message": message, "seconds": time.monotonic() - t0,
                          "peak_rss_mb": peak}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
