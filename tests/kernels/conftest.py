"""Shared fixtures for the kernel tests: one parametrized ``backend`` and the tolerance rule.

Triton runs here on CPU tensors through its interpreter, which triton 3.9 selects when a kernel is decorated,
so TRITON_INTERPRET must be set before any ``shardkit.kernels`` module is imported: done at the top of this
conftest, which pytest imports before the test modules of this folder. The C++ build is shared across tests
(and across runs) through TORCH_EXTENSIONS_DIR, defaulting to the repository's ``.torch_extensions/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".torch_extensions"))

import pytest  # noqa: E402

from shardkit.ops import available_backends, force_backend  # noqa: E402


@dataclass(frozen=True)
class Backend:
    """A backend under test and the device its tensors live on."""

    name: str
    device: str

    @property
    def interpreted(self) -> bool:
        """Triton on CPU: about 100x slower than torch, so tests keep these shapes tiny."""
        return self.name == "triton" and self.device == "cpu"


_CANDIDATES = [Backend("reference", "cpu"), Backend("cpp", "cpu"), Backend("triton", "cpu")]
if torch.cuda.is_available():
    _CANDIDATES += [Backend("reference", "cuda"), Backend("triton", "cuda"), Backend("cuda", "cuda")]


@pytest.fixture(params=_CANDIDATES, ids=lambda b: f"{b.name}-{b.device}")
def backend(request) -> Backend:
    """Each backend present on this machine, forced for the duration of the test; absent ones skip."""
    b: Backend = request.param
    if b.name not in available_backends(b.device):
        pytest.skip(f"backend {b.name} not available on {b.device} here")
    with force_backend(b.name):
        yield b


# fp32 outputs are held to ~1e-5 absolute on O(1)..O(10) values; bf16 to one ulp near 1 (2^-8 = 0.0039).
ATOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3}


def rand(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
         scale: float = 1.0) -> torch.Tensor:
    """Random normal tensor (never all zeros), reproducible per seed, created in fp32 then cast."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def max_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    return (a.detach().double().cpu() - ref64.detach().double().cpu()).abs().max().item()


def assert_close_to_reference(out: torch.Tensor, ref_lowp: torch.Tensor, ref64: torch.Tensor,
                              atol: float | None = None, name: str = "output") -> None:
    """The fused result's error vs fp64 is at most 2x PyTorch's own error at the same dtype, plus ``atol``.

    ``atol`` defaults to ``ATOL[out.dtype]``.
    """
    atol = ATOL[out.dtype] if atol is None else atol
    # NOTE: atol is for O(1) values; a sum-reduced loss or its gradients reach O(100), where one fp32 ulp is
    # 1.5e-5 and a different summation order (the CUDA kernels' vs cuBLAS's) moves the result by a few ulps
    # (seen on an H100: 4.7e-5 on a loss of ~330). Scale it by the reference's magnitude.
    atol *= max(1.0, ref64.detach().abs().max().item()) if ref64.numel() else 1.0
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert out.dtype == ref_lowp.dtype, f"{name}: dtype {out.dtype} != {ref_lowp.dtype}"
    err, ref_err = max_err(out, ref64), max_err(ref_lowp, ref64)
    assert err <= 2 * ref_err + atol, f"{name}: error {err:.3g} > 2 x torch's {ref_err:.3g} + {atol:g}"


# Test modules here are not a package, so helpers are handed out as fixtures rather than imported.
@pytest.fixture
def make_rand(request):
    """:func:`rand`: ``make_rand(*shape, dtype=, device=, seed=, scale=)``.

    In a test that takes ``backend``, tensors default to the backend's device, so a CUDA backend is fed CUDA
    tensors (left on the CPU they would be dispatched to a CPU kernel and the GPU one never run).
    """
    if "backend" not in request.fixturenames:
        return rand
    device = request.getfixturevalue("backend").device
    return lambda *shape, device=device, **kw: rand(*shape, device=device, **kw)


@pytest.fixture
def check_close():
    """:func:`assert_close_to_reference`: ``check_close(out, ref_lowp, ref64, atol, name)``."""
    return assert_close_to_reference
