"""The Triton kernels compile for real GPUs (sm_80, sm_90) without spilling, checked on a machine without one.

The other kernel tests run Triton under its interpreter, which never lowers a kernel; scripts/check_triton.py
compiles every launcher's launches with Triton's own compiler and reads each cubin's resource use. It runs in a
subprocess because TRITON_INTERPRET=1, set for this folder by conftest.py, must be unset for it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_triton.py"
TRITON_DIR = REPO / "sdk" / "kernels"  # the package shardkit.kernels


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)


def _triton_files() -> list[Path]:
    """The Triton file of every registered op with compile checks (``OpSpec.triton_checks``)."""
    from shardkit.ops.registry import registered_ops

    modules = [spec.triton_checks.partition(":")[0] for spec in registered_ops() if spec.triton_checks]
    return [TRITON_DIR / f"{m.removeprefix('shardkit.kernels.')}.py" for m in modules]


def _jit_kernels() -> set[str]:
    """Names of the launchable ``@triton.jit`` functions (``*_kernel``) in the registered ops' Triton files."""
    names = set()
    for path in _triton_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                names.add(node.name)
    return names


def test_every_triton_file_belongs_to_a_registered_op():
    """A sdk/kernels/<op>.py that no OpSpec names would never be compile-checked (nor dispatched)."""
    files = {p.name for p in _triton_files()}
    assert all(p.exists() for p in _triton_files()), _triton_files()
    orphans = [p.name for p in TRITON_DIR.glob("*.py") if not p.name.startswith("_") and p.name not in files]
    assert not orphans, f"Triton files with no OpSpec(triton_checks=...) in shardkit.ops: {orphans}"


def test_every_triton_kernel_compiles_for_sm80_and_sm90_without_spills():
    proc = _python(str(SCRIPT))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    kernels = _jit_kernels()
    assert len(kernels) >= 7, kernels  # rms_norm fwd/bwd, rope, swiglu fwd/bwd, flce rows, adamw
    missing = [k for k in sorted(kernels) if f"| {k} |" not in proc.stdout]
    assert not missing, f"kernels with no launch in their op's OpSpec.triton_checks: {missing}"
    assert "0 with problems" in proc.stdout


def test_checker_reports_a_spilling_launch():
    # rms_norm's backward at a 8192-wide row with 4 warps holds 64 fp32 per thread per row tensor: it spilled
    # before the launcher scaled num_warps with the row width. The checker must say so.
    code = f"""
import sys, torch
sys.path.insert(0, {str(SCRIPT.parent)!r})
import check_triton
from shardkit.kernels import rms_norm
m = lambda *s, dtype=torch.float32: torch.empty(*s, dtype=dtype, device="meta")
x, w = m(64, 8192, dtype=torch.bfloat16), m(8192, dtype=torch.bfloat16)
launch = lambda: rms_norm._rms_norm_bwd_kernel[(4,)](x, x, w, m(64), x, m(4, 8192), 64, 8192, 16, 0.0,
                                                      BLOCK=8192, num_warps=4)
rows = check_triton.compile_all([90], [("bwd 8192 at 4 warps", launch)])
print([r.problem for r in rows])
"""
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spills" in proc.stdout and "local memory" in proc.stdout, proc.stdout
