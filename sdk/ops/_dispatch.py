"""Backend selection for the fused ops: per tensor device, overridable by env or in tests.

Order of preference (first available wins):

- CUDA tensors: ``cuda`` (the ``shardkit_C`` CUDA kernels), ``triton``, ``reference``.
- CPU tensors: ``cpp`` (the ``shardkit_C`` CPU kernels), ``reference``. Triton is never chosen on its
  own for CPU tensors: it runs there only under ``TRITON_INTERPRET=1``, about 100x slower than torch.

``SHARDKIT_KERNEL_BACKEND=reference|cpp|triton|cuda`` (or :func:`force_backend` in tests) forces one.
A forced backend that cannot run on the tensors' device raises an error naming the fix; an op that does
not implement the forced backend at all (e.g. an optimizer without Triton) uses its default order.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence

import torch

from shardkit.utils.suggest import did_you_mean

from ._builder import BUILDER

__all__ = [
    "BACKENDS",
    "available_backends",
    "force_backend",
    "forced_backend",
    "has_native_kernel",
    "select_backend",
    "triton_runnable",
]

BACKENDS = ("reference", "cpp", "triton", "cuda")
_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpp", "reference")}
_forced: list[str] = []


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r} from {source}{did_you_mean(name, BACKENDS)}; choose one of "
                         f"{', '.join(BACKENDS)}")
    return name


def forced_backend() -> str | None:
    """The backend forced by :func:`force_backend` (innermost) or ``SHARDKIT_KERNEL_BACKEND``, if any."""
    if _forced:
        return _forced[-1]
    env = os.environ.get("SHARDKIT_KERNEL_BACKEND", "").strip().lower()
    return _check(env, "SHARDKIT_KERNEL_BACKEND") if env else None


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Force ``name`` for every op called inside the block (takes precedence over the env var)."""
    _forced.append(_check(name, "force_backend()"))
    try:
        yield
    finally:
        _forced.pop()


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken triton install is the same as none
        return False
    return True


def triton_runnable(device_type: str) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1``.

    NOTE: triton 3.x reads TRITON_INTERPRET when a kernel is *decorated*, i.e. when ``shardkit.kernels.<op>``
    is first imported, so set it before the first Triton call of the process.
    """
    if not _triton_importable():
        return False
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def has_native_kernel(kernel: str, device_type: str) -> bool:
    """True when ``torch.ops.shardkit_C.<kernel>`` has a kernel for the device (builds on first use)."""
    if device_type == "cuda" and not BUILDER.with_cuda():
        return False
    if not BUILDER.available():
        return False
    key = "CUDA" if device_type == "cuda" else "CPU"
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"{BUILDER.name}::{kernel}", key)
    except RuntimeError:  # the library has no such operator (e.g. an op whose source is not built)
        return False


def _runnable(backend: str, device_type: str, kernel: str) -> bool:
    if backend == "reference":
        return True
    if backend == "triton":
        return triton_runnable(device_type)
    if backend == "cpp":
        return device_type == "cpu" and has_native_kernel(kernel, "cpu")
    return device_type == "cuda" and has_native_kernel(kernel, "cuda")


def available_backends(device: torch.device | str, kernel: str | None = None) -> tuple[str, ...]:
    """Backends that can run on ``device`` (all native kernels, or just ``kernel``), best first.

    Includes triton on CPU under TRITON_INTERPRET=1, although :func:`select_backend` never picks it there
    unless forced.
    """
    device_type = torch.device(device).type
    order = _ORDER.get(device_type, ("reference",))
    extra = ("triton",) if device_type == "cpu" else ()
    found = []
    for backend in order[:-1] + extra + order[-1:]:
        if kernel is None and backend in ("cpp", "cuda"):
            ok = BUILDER.available() and (backend == "cpp" or BUILDER.with_cuda())
        else:
            ok = _runnable(backend, device_type, kernel or "")
        if ok:
            found.append(backend)
    return tuple(found)


def select_backend(kernel: str, device: torch.device | str, supported: Sequence[str] = BACKENDS,
                   op: str | None = None) -> str:
    """Pick the backend for one call (ops call it through ``OpSpec.select``, which passes their table).

    Args:
        kernel: the raw ``shardkit_C`` kernel the call would use (e.g. ``"rms_norm_fwd"``); checked for the
            cpp/cuda backends, and named in errors.
        device: the device of the op's tensors.
        supported: the backends this op implements.
        op: the op's name, for errors.

    Returns:
        One of :data:`BACKENDS`.

    Raises:
        RuntimeError: a forced backend cannot run on ``device``.
    """
    device_type = torch.device(device).type
    forced = forced_backend()
    if forced is not None and forced in supported:
        if not _runnable(forced, device_type, kernel):
            hint = {"triton": "set TRITON_INTERPRET=1 before importing shardkit.kernels to run Triton on CPU",
                    "cpp": "the C++ CPU kernels need CPU tensors and a working build (see the warning above)",
                    "cuda": "the CUDA kernels need CUDA tensors and a CUDA build of torch"}.get(forced, "")
            who = f"op {op!r}: " if op else ""
            raise RuntimeError(f"{who}kernel backend {forced!r} forced (SHARDKIT_KERNEL_BACKEND or force_backend) "
                               f"cannot run {kernel} on {device_type} tensors: {hint}; unset it or pick another of "
                               f"{', '.join(supported)}")
        return forced
    for backend in _ORDER.get(device_type, ("reference",)):
        if backend in supported and _runnable(backend, device_type, kernel):
            return backend
    return "reference"
