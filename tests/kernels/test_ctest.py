"""The torch-free C++ cores pass their own ctest suite (CMakeLists.txt, csrc/tests/: each kernel vs a scalar
C++ reference), built from scratch with OpenMP at two threads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    beside = Path(sys.executable).with_name(name)  # the `cmake` wheel of requirements-test.txt
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: `pip install -r requirements-test.txt` installs it into the environment")
    return found


def test_cpu_cores_pass_ctest(tmp_path):
    build = tmp_path / "cmake"
    steps = [[_tool("cmake"), "-S", str(REPO), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
             [_tool("cmake"), "--build", str(build), "-j2"],
             [_tool("ctest"), "--test-dir", str(build), "--output-on-failure"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    tests = sorted(p.stem for p in (REPO / "csrc" / "tests").glob("test_*.cpp"))
    summary = [line for line in proc.stdout.splitlines() if "tests passed" in line]
    assert summary and summary[0].startswith("100% tests passed") and summary[0].endswith(f"out of {len(tests)}"), \
        proc.stdout[-3000:]
