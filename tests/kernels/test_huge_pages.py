"""Large outputs of the C++ CPU ops are advised to transparent huge pages, and stay correct.

The advice is visible in /proc/self/smaps: the mapping that holds the output carries the VmFlags entry
``hg`` (MADV_HUGEPAGE). Whether the kernel then finds 2 MiB pages depends on the machine, so only the
advice is asserted; benchmarks/RESULTS.md has what it buys in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardkit.ops import force_backend, rms_norm, rms_norm_reference, swiglu, swiglu_reference
from shardkit.ops._dispatch import has_native_kernel

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux-only"),
    pytest.mark.skipif(not has_native_kernel("swiglu_fwd", "cpu"), reason="C++ ops unavailable"),
]

# Each in a fresh process: in a long one, glibc serves later allocations from heap memory that an earlier large
# output's advice already covers, so a small tensor can sit in an advised mapping without being advised itself.
_ADVISED_PROBE = """
import torch
from shardkit.ops import force_backend, swiglu
from tests.kernels.test_huge_pages import advised
g = torch.randn({n}, 4096)
with force_backend("cpp"):
    y = swiglu(g, torch.randn({n}, 4096))
print(advised(y))
"""


def _probe(rows: int, huge_pages: str) -> str:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "SHARDKIT_HUGE_PAGES": huge_pages, "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", _ADVISED_PROBE.format(n=rows)], capture_output=True, text=True,
                         env=env, cwd=repo, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def advised(t: torch.Tensor) -> bool:
    """True when the mapping holding the middle of ``t``'s storage has the MADV_HUGEPAGE flag (``hg``)."""
    address = t.data_ptr() + t.untyped_storage().nbytes() // 2
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


def test_large_outputs_are_advised_and_correct():
    gen = torch.Generator().manual_seed(0)
    gate = torch.randn(1024, 4096, generator=gen, requires_grad=True)  # 16 MiB: above the 4 MiB threshold
    up = torch.randn(1024, 4096, generator=gen, requires_grad=True)
    x = torch.randn(1024, 4096, generator=gen, requires_grad=True)
    w = torch.randn(4096, generator=gen, requires_grad=True)
    with force_backend("cpp"):
        y = swiglu(gate, up)
        z = rms_norm(x, w, 1e-6)
    assert advised(y) and advised(z)

    grad = torch.randn(1024, 4096, generator=gen)
    torch.autograd.backward([y, z], [grad, grad])
    assert advised(gate.grad) and advised(x.grad)
    ref_gate, ref_up, ref_x, ref_w = (t.detach().clone().requires_grad_() for t in (gate, up, x, w))
    torch.autograd.backward([swiglu_reference(ref_gate, ref_up), rms_norm_reference(ref_x, ref_w, 1e-6)],
                            [grad, grad])
    torch.testing.assert_close(y, swiglu_reference(gate, up))
    torch.testing.assert_close(z, rms_norm_reference(x, w, 1e-6))
    for ours, ref in ((gate, ref_gate), (up, ref_up), (x, ref_x), (w, ref_w)):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows, value, expected", [(1024, "0", "False"), (1024, "1", "True"), (4, "1", "False")],
                         ids=["16MiB-off", "16MiB-on", "64KiB-left-alone"])
def test_env_switch_and_threshold(rows, value, expected):
    assert _probe(rows, value) == expected
