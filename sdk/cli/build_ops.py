"""`shardkit build-ops`: build the JIT-compiled ops ahead, where the runs on this machine will look for them.

    shardkit build-ops               # shardkit's C++ ops (shardkit_C)
    shardkit build-ops --deepspeed   # and the DeepSpeed ops shardkit's ZeRO strategies load here

The first ZeRO run otherwise stops for minutes to compile DeepSpeed's ops (cpu_adam ~1.5 min, async_io ~5 min
on 2 cores). Builds go through the same lock and supervisor as a run's (one build however many processes ask;
a killed build leaves nothing that trips the next) into the same folder: ``$TORCH_EXTENSIONS_DIR``, else the
per-environment default of :func:`shardkit.ops.build_lock.extensions_root`. One line per op: built, where, or
skipped and why. The exit code is 1 when a build failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["build_ops", "register"]

def _build(label: str, build: Callable[[], Path | None], out) -> bool:
    """Run one build, printing what was built and where (or why not); False when it failed."""
    start = time.perf_counter()
    print(f"building {label} ...", file=out, flush=True)
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # DeepSpeed prints its own chatter
            where = build()
    except Exception as err:  # noqa: BLE001 - report every failure, keep building the rest
        print(f"  FAILED after {time.perf_counter() - start:.0f} s: {type(err).__name__}: {err}", file=out,
              flush=True)
        return False
    if where is None:
        print("  skipped: DeepSpeed marks this op incompatible with this machine", file=out, flush=True)
        return True
    print(f"  ready in {time.perf_counter() - start:.0f} s: {where}", file=out, flush=True)
    return True


def _shardkit_op() -> Path:
    from shardkit.ops import BUILDER

    return Path(BUILDER.load())


def build_ops(deepspeed: bool = False, shardkit_ops: bool = True, out=None) -> bool:
    """Build shardkit's C++ ops and, with ``deepspeed``, DeepSpeed's that ZeRO loads here; True when none failed."""
    from shardkit.ops.build_lock import extensions_root

    out = sys.stdout if out is None else out
    source = ("TORCH_EXTENSIONS_DIR" if os.environ.get("TORCH_EXTENSIONS_DIR") else
              "the default for this environment; set TORCH_EXTENSIONS_DIR to choose another")
    print(f"ops folder: {extensions_root()} ({source})", file=out, flush=True)
    ok = _build("shardkit_C (shardkit's C++ ops)", _shardkit_op, out) if shardkit_ops else True
    if not deepspeed:
        return ok
    from shardkit.strategies.zero.prebuild import build_deepspeed_ops

    return build_deepspeed_ops(lambda label, build: _build(label, build, out), out) and ok


def _run(args: argparse.Namespace) -> int:
    return 0 if build_ops(deepspeed=args.deepspeed) else 1


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``build-ops``; its ``func`` default takes the parsed args and returns the exit code."""
    p = subparsers.add_parser(
        "build-ops", help="build the C++ ops ahead (--deepspeed: and DeepSpeed's, for ZeRO)",
        description=__doc__.splitlines()[0] + " Into $TORCH_EXTENSIONS_DIR, else a folder per environment under "
        "torch's cache (~/.cache/torch_extensions).")
    p.add_argument("--deepspeed", action="store_true",
                   help="also DeepSpeed's ops that shardkit's ZeRO strategies load on this machine: shm_comm (CPU "
                        "accelerator), cpu_adam (optimizer offload), async_io (NVMe offload; needs libaio)")
    p.set_defaults(func=_run)
    return p
