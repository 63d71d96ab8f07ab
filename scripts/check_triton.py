"""Compile every Triton kernel for real GPUs on a machine without one, and report what each costs the GPU.

The tests run the Triton kernels under TRITON_INTERPRET=1, which executes their Python semantics on CPU tensors
but never lowers them: a kernel can pass every CPU test and still fail to compile for a GPU, ask for more shared
memory than the GPU has, or compile into a loop that spills registers to local memory. This script drives every
launcher of every registered op (``OpSpec.triton_checks`` in ``shardkit.ops.registry`` names a function beside
the op's kernels in ``sdk/kernels/<op>.py``) with meta tensors at the shapes a real model uses, turns each launch into
Triton's own ahead-of-time compile (same binder, specialisation and options as a real launch, nothing run) for
sm_80 (A100) and sm_90 (H100), and reads the resource use of each cubin with the cuobjdump that ships with Triton.

Fails (exit 1) when a kernel does not compile, spills (local memory > 0), or needs more shared memory than the
architecture gives one block. Prints one markdown row per launch and architecture (registers per thread,
shared memory, and the theoretical occupancy those allow).

Usage: python scripts/check_triton.py [--arch 80 90] [--json FILE]     (TRITON_INTERPRET must be unset)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("check_triton.py: unset TRITON_INTERPRET; the interpreter never compiles kernels")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout without `pip install -e .`

# Per block, the most shared memory an SM of this architecture grants (opt-in maximum), its register file, and
# its thread limit: CUDA C Programming Guide, "Compute Capabilities", for 8.0 and 9.0.
ARCHS = {80: {"name": "A100", "smem_per_block": 163 * 1024, "smem_per_sm": 164 * 1024},
         90: {"name": "H100", "smem_per_block": 227 * 1024, "smem_per_sm": 228 * 1024}}
REGS_PER_SM, THREADS_PER_SM, BLOCKS_PER_SM, WARPS_PER_SM = 65536, 2048, 32, 64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Row:
    """One compiled launch on one architecture."""

    kernel: str
    case: str
    arch: int
    num_warps: int
    registers: int
    local_bytes: int
    shared_bytes: int
    occupancy: float
    problem: str = ""


class _CompileOnlyDriver:
    """Stands in for the CUDA driver: names the target, owns no device; launches become compiles."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        # NOTE: a JITFunction caches its binder, target and compiled kernels per device id: one id per
        # architecture, or the second architecture would be handed the first one's kernels.
        return self.target.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def cases() -> list[tuple[str, Callable[[], object]]]:
    """(label, call) for each launcher at the shapes that matter: every registered op's ``triton_checks``."""
    from shardkit.ops.registry import registered_ops

    out: list[tuple[str, Callable[[], object]]] = []
    for spec in registered_ops():
        if spec.triton_checks is not None:
            module, _, function = spec.triton_checks.partition(":")
            out += getattr(importlib.import_module(module), function)(DTYPES)
    return out


def _resources(cubin: bytes, cuobjdump: str) -> tuple[int, int]:
    """(registers per thread, local-memory bytes per thread) of the one function in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{text}")
    regs, stack, local = (int(v) for v in match.groups())
    return regs, stack + local


def occupancy(arch: int, num_warps: int, registers: int, shared: int) -> float:
    """Resident warps per SM over the 64 an SM holds, from registers (256-register warp granules), shared
    memory (1 KiB reserved per block) and the thread and block limits."""
    threads = 32 * num_warps
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = REGS_PER_SM // (per_warp * num_warps) if registers else BLOCKS_PER_SM
    by_smem = ARCHS[arch]["smem_per_sm"] // (shared + 1024)
    blocks = min(by_regs, by_smem, THREADS_PER_SM // threads, BLOCKS_PER_SM)
    return blocks * num_warps / WARPS_PER_SM


def compile_all(archs: list[int], launches: list[tuple[str, Callable[[], object]]] | None = None) -> list[Row]:
    """Compile every launch of ``launches`` (default :func:`cases`) for every architecture in ``archs``."""
    cuobjdump = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    launched: list[tuple[str, object]] = []

    def compile_instead(self, grid):
        def launch(*args, **kwargs):
            launched.append((self.fn.__name__, self.run(*args, grid=grid, warmup=True, **kwargs)))
        return launch

    original = KernelInterface.__getitem__
    KernelInterface.__getitem__ = compile_instead
    rows: list[Row] = []
    try:
        for arch in archs:
            driver.set_active(_CompileOnlyDriver(arch))
            for label, call in launches if launches is not None else cases():
                launched.clear()
                try:
                    call()
                except Exception as exc:  # noqa: BLE001 - report the kernel that failed, keep going
                    rows.append(Row("?", label, arch, 0, 0, 0, 0, 0.0, f"{type(exc).__name__}: {exc}"[:300]))
                    continue
                for name, kernel in launched:
                    regs, local = _resources(kernel.asm["cubin"], cuobjdump)
                    md = kernel.metadata
                    row = Row(name, label, arch, md.num_warps, regs, local, md.shared,
                              occupancy(arch, md.num_warps, regs, md.shared))
                    if local:
                        row.problem = f"spills {local} B/thread to local memory"
                    if md.shared > ARCHS[arch]["smem_per_block"]:
                        row.problem = f"needs {md.shared} B shared memory > {ARCHS[arch]['smem_per_block']}"
                    rows.append(row)
    finally:
        KernelInterface.__getitem__ = original
        driver.set_active(None)  # NOTE: not reset_active(), which would look for a real GPU driver at once
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=sorted(ARCHS), choices=sorted(ARCHS))
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = compile_all(args.arch)
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    print("| kernel | launch | warps | " + " | ".join(
        f"sm_{a}: regs / local B / shared B / occupancy" for a in args.arch) + " |")
    print("|---|---|---|" + "---|" * len(args.arch))
    table: dict[tuple[str, str], dict[int, Row]] = {}
    for r in rows:  # q and k launches of one rope call compile to the same kernel: one line each
        table.setdefault((r.kernel, r.case), {})[r.arch] = r
    for (kernel, case), by_arch in table.items():
        cells = [f"{r.registers} / {r.local_bytes} / {r.shared_bytes} / {r.occupancy:.0%}"
                 + (f" **{r.problem}**" if r.problem else "") for r in (by_arch.get(a) for a in args.arch) if r]
        print(f"| {kernel} | {case} | {next(iter(by_arch.values())).num_warps} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    bad = [r for r in rows if r.problem]
    print(f"{len(rows) - len(bad)} launches compiled clean, {len(bad)} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
