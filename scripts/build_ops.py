"""Build every JIT-compiled op the test suite uses, once, into TORCH_EXTENSIONS_DIR.

    python scripts/build_ops.py

shardkit's own C++ extension (shardkit_C) and the DeepSpeed ops its ZeRO strategies load on a CPU
machine: shm_comm (gloo-side shared-memory collectives), cpu_adam (optimizer offload) and async_io
(NVMe offload; needs libaio-dev). Built here, the tests reuse them instead of compiling inside a
test's time limit. One line per build; a failed build is reported and the others still run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _timed(label: str, build) -> bool:
    start = time.perf_counter()
    print(f"building {label} ...", flush=True)
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            built = build()
    except Exception as err:  # noqa: BLE001 - report every failure, keep building the rest
        print(f"  FAILED after {time.perf_counter() - start:.0f} s: {type(err).__name__}: {err}", flush=True)
        return False
    if built is False:
        print("  skipped: DeepSpeed marks this op incompatible with this machine", flush=True)
        return True
    print(f"  ready in {time.perf_counter() - start:.0f} s", flush=True)
    return True


def main() -> int:
    from shardkit.ops import BUILDER

    ok = _timed("shardkit_C (shardkit's C++ ops)", BUILDER.load)
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("deepspeed is not installed: skipping its ops")
        return 0 if ok else 1
    builders = {"ShareMemCommBuilder": "shm_comm", "CPUAdamBuilder": "cpu_adam"}
    if Path("/usr/include/libaio.h").exists():
        builders["AsyncIOBuilder"] = "async_io"
    else:
        print("libaio-dev is missing: skipping DeepSpeed async_io (NVMe offload tests will skip)")
    from shardkit.strategies.zero.strategy import build_deepspeed_op

    for builder_name, label in builders.items():
        if get_accelerator().create_op_builder(builder_name) is None:
            print(f"DeepSpeed has no {builder_name} for this accelerator: skipping")
            continue
        # through shardkit's build lock, as a ZeRO run builds: a baton left by a killed `make test` would
        # otherwise make DeepSpeed's own load wait for ever (seen: a 10-minute wait on async_io's)
        ok &= _timed(f"DeepSpeed {label}", lambda name=builder_name: build_deepspeed_op(name))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
