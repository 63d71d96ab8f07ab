"""Build every JIT-compiled op the test suite uses, once, into TORCH_EXTENSIONS_DIR: `make test` runs it first.

    python scripts/build_ops.py

The same as ``shardkit build-ops --deepspeed`` (sdk/cli/build_ops.py), the one entry: shardkit's own C++ extension
(shardkit_C) and the DeepSpeed ops its ZeRO strategies load on this machine (shm_comm on the CPU accelerator,
cpu_adam for optimizer offload, async_io for NVMe offload when libaio is installed). Built here, the tests reuse them
instead of compiling inside a test's time limit. One line per build; a failed build is reported and the others
still run.
"""

from __future__ import annotations

import sys

from shardkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["build-ops", "--deepspeed"]))
