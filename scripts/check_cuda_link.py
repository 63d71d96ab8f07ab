"""Build, link and load the whole shardkit_C extension with its CUDA kernels, on a machine without a GPU.

Run it with the Python of a CUDA build of torch (and nvcc of the same CUDA major version on PATH or CUDA_HOME):
it JIT-builds every csrc/ source through the one builder (sdk/ops/_builder.py, loaded by path so shardkit's
other dependencies are not needed) for the architectures in TORCH_CUDA_ARCH_LIST (default "8.0;9.0"), into a
fresh temporary TORCH_EXTENSIONS_DIR (loaded by path the builder has no op registry and compiles every op folder
of csrc/, which tests/kernels/test_builder.py checks are exactly the registered ops'), loads the library (no GPU
is needed to load it) and checks that every shardkit_C op has both a CPU and a CUDA kernel. This is the step
scripts/check_cuda.sh cannot do with a CPU build of torch: compiling the torch bindings for real and linking them
against libtorch_cuda.

Usage: /path/to/cuda-torch/python scripts/check_cuda_link.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="shardkit_cuda_link_")
    import torch

    if not torch.version.cuda:
        print(f"check_cuda_link.py: torch {torch.__version__} is a CPU build; run this with a CUDA build's Python",
              file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("shardkit_builder", REPO / "sdk" / "ops" / "_builder.py")
    builder_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder_module)
    builder = builder_module.BUILDER
    if not builder.with_cuda():
        print("check_cuda_link.py: no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    cuda_sources = [s for s in builder.sources() if s.endswith(".cu") or s.endswith("_cuda_binding.cpp")]
    start = time.monotonic()
    library = builder.load()  # raises ExtensionUnavailable with the compiler's reason
    print(f"built and loaded {library} in {time.monotonic() - start:.0f} s: {len(builder.sources())} sources "
          f"({len(cuda_sources)} CUDA), torch {torch.__version__}, archs {os.environ['TORCH_CUDA_ARCH_LIST']}")
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{builder.name}::"))
    missing = []
    for op in ops:
        keys = [k for k in ("CPU", "CUDA") if torch._C._dispatch_has_kernel_for_dispatch_key(op, k)]
        print(f"  {op}: {' + '.join(keys)}")
        if keys != ["CPU", "CUDA"]:
            missing.append(op)
    if not ops or missing:
        print(f"check_cuda_link.py: ops without both kernels: {missing or 'no ops registered'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
