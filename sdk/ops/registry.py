"""One spec per fused op: its reference, a backend table per kernel, its C++ folder and its Triton checks.

Every op module (``sdk/ops/<op>.py``) ends with ``SPEC = register(OpSpec(...))``; everything that used to keep a
list of ops by hand reads this registry instead: dispatch (:meth:`OpSpec.select` and :meth:`OpSpec.call` in place
of ``if backend == ...`` chains), the extension builder (``csrc/<spec.csrc>/`` sources), ``scripts/check_triton.py``
(``spec.triton_checks``), the kernel tests and ``benchmarks/kernels.py`` (``spec.example``). A backend table maps
each backend to its implementation for one kernel (one entry point, e.g. ``rms_norm_fwd``); implementations that
need an optional dependency are given as ``"module:attribute"`` strings and imported on first use, so importing
``shardkit.ops`` never imports Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from shardkit.utils.suggest import did_you_mean

from ._builder import add_op_dir
from ._dispatch import BACKENDS, select_backend

__all__ = ["Impl", "OpSpec", "direct_call_ok", "get_op", "native", "native_source_dirs", "register", "registered_ops"]

Impl = Callable[..., Any] | str
"""An implementation: a callable, or ``"module:attribute"`` imported on first use."""

_OPS: dict[str, OpSpec] = {}


def native(kernel: str) -> dict[str, Callable[..., Any]]:
    """The ``cpp`` and ``cuda`` entries of a backend table: both are ``torch.ops.shardkit_C.<kernel>``.

    The torch dispatcher picks the CPU or CUDA kernel from the tensors; the op is looked up at call time, after
    dispatch has built and loaded the library.
    """
    def call(*args: Any) -> Any:
        return getattr(torch.ops.shardkit_C, kernel)(*args)

    call.__name__ = call.__qualname__ = f"shardkit_C.{kernel}"
    return {"cpp": call, "cuda": call}


def direct_call_ok(*tensors: torch.Tensor | None) -> bool:
    """Whether an op may run its implementation directly instead of through its ``torch.library`` custom op.

    The custom op is there for autograd, torch.compile and tensor subclasses; in plain eager inference it only
    adds its Python dispatch: 15 us a call on an idle 2-core CPU, twice the rms_norm kernel itself at decoding
    shapes ((4, 1, 128): 6 us), and a 4-layer Llama makes 17 such calls per token (decoding 1.26x faster
    without it, benchmarks/kv_cache.py). So it is skipped when no tensor wants a gradient, every tensor is a
    plain tensor (no DTensor, FakeTensor or functional wrapper) and nothing is tracing (dynamo, or a dispatch
    mode such as make_fx's).
    """
    present = [t for t in tensors if t is not None]
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in present):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in present))


def _resolve(impl: Impl, op: str, backend: str) -> Callable[..., Any]:
    if callable(impl):
        return impl
    module, _, attr = impl.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise RuntimeError(f"op {op!r}, backend {backend!r}: cannot import {module} ({type(exc).__name__}: {exc}); "
                           f"install what it needs (e.g. `pip install triton` for the triton backend) or force "
                           f"another backend with SHARDKIT_KERNEL_BACKEND") from exc
    except AttributeError as exc:
        raise RuntimeError(f"op {op!r}, backend {backend!r}: {module} has no {attr!r}; fix the backend table of "
                           f"{op!r} in shardkit.ops") from exc


@dataclass(frozen=True)
class OpSpec:
    """Everything shardkit needs to know about one fused op.

    Args:
        name: the op's name (``"rms_norm"``); also the name of its Triton file, ``sdk/kernels/<name>.py``.
        function: the public fused function (``shardkit.ops.rms_norm``).
        reference: the plain-PyTorch oracle with the same signature (fallback and test oracle).
        kernels: for each kernel (entry point; for cpp/cuda the ``shardkit_C`` op it calls), the backend table
            ``{"reference": ..., "cpp": ..., "cuda": ..., "triton": ...}``. Every table has a reference; the
            implementations of one table share one signature.
        csrc: the folder under ``csrc/`` holding the op's C++/CUDA sources, or None (no native backend).
        triton_checks: ``"module:function"``; ``function(dtypes)`` returns ``(label, launch)`` pairs that launch
            every Triton kernel of the op on meta tensors at real model shapes (``scripts/check_triton.py``).
        example: ``example(device, dtype, size)`` returns positional arguments for ``function`` and ``reference``
            (floating leaves that take a gradient have ``requires_grad``): ``size="test"`` tiny (the registry
            test), ``size="bench"`` the benchmark's shape (``benchmarks/kernels.py``). None: no such case.
    """

    name: str
    function: Callable[..., Any]
    reference: Callable[..., Any]
    kernels: Mapping[str, Mapping[str, Impl]]
    csrc: str | None = None
    triton_checks: str | None = None
    example: Callable[..., tuple] | None = None
    _cache: dict[tuple[str, str], Callable[..., Any]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for kernel, table in self.kernels.items():
            for backend in table:
                if backend not in BACKENDS:
                    raise ValueError(f"op {self.name!r}, kernel {kernel!r}: unknown backend {backend!r} in its table "
                                     f"(backends are {', '.join(BACKENDS)}){did_you_mean(backend, BACKENDS)}")
            if "reference" not in table:
                raise ValueError(f"op {self.name!r}, kernel {kernel!r}: the backend table needs a 'reference' entry "
                                 "(the fallback every device can run)")

    def _table(self, kernel: str) -> Mapping[str, Impl]:
        table = self.kernels.get(kernel)
        if table is None:
            raise KeyError(f"op {self.name!r} has no kernel {kernel!r} (its kernels: {', '.join(self.kernels)})"
                           f"{did_you_mean(kernel, self.kernels)}")
        return table

    def backends(self, kernel: str) -> tuple[str, ...]:
        """The backends ``kernel`` implements, in :data:`BACKENDS` order."""
        table = self._table(kernel)
        return tuple(b for b in BACKENDS if b in table)

    @property
    def native_kernels(self) -> tuple[str, ...]:
        """The ``shardkit_C`` kernels dispatch calls (the kernels whose table has a cpp entry)."""
        return tuple(k for k, table in self.kernels.items() if "cpp" in table)

    def select(self, kernel: str, device: torch.device | str) -> str:
        """The backend for one call of ``kernel`` on ``device`` (:func:`shardkit.ops.select_backend`)."""
        return select_backend(kernel, device, self.backends(kernel), op=self.name)

    def implementation(self, kernel: str, backend: str) -> Callable[..., Any]:
        """The implementation of ``kernel`` on ``backend`` (imported on first use).

        Raises:
            ValueError: the op does not implement ``backend`` for ``kernel`` (names the closest one).
            RuntimeError: the implementation's module cannot be imported (names what to install).
        """
        found = self._cache.get((kernel, backend))
        if found is None:
            table = self._table(kernel)
            if backend not in table:
                raise ValueError(f"op {self.name!r} has no backend {backend!r} for {kernel}: pick one of "
                                 f"{', '.join(self.backends(kernel))}{did_you_mean(backend, table)}")
            found = self._cache[(kernel, backend)] = _resolve(table[backend], self.name, backend)
        return found

    def call(self, kernel: str, backend: str, *args: Any) -> Any:
        """Run ``kernel`` on ``backend`` with ``args`` (the table's shared signature)."""
        return self.implementation(kernel, backend)(*args)


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to the registry and return it (``SPEC = register(OpSpec(...))`` at the end of an op module).

    Raises:
        ValueError: another op of that name, or a kernel another op already owns, is registered.
    """
    if spec.name in _OPS and _OPS[spec.name] is not spec:
        raise ValueError(f"op {spec.name!r} is registered twice; give the new op another name")
    for other in _OPS.values():
        shared = set(other.kernels) & set(spec.kernels) if other.name != spec.name else set()
        if shared:
            raise ValueError(f"op {spec.name!r}: kernels {sorted(shared)} already belong to op {other.name!r}; "
                             "kernel names must be unique across ops (they share the shardkit_C namespace)")
    _OPS[spec.name] = spec
    if spec.csrc is not None:
        add_op_dir(spec.csrc)
    return spec


def registered_ops() -> tuple[OpSpec, ...]:
    """Every registered op, in registration order (importing ``shardkit.ops`` registers the built-in ones)."""
    importlib.import_module("shardkit.ops")
    return tuple(_OPS.values())


def get_op(name: str) -> OpSpec:
    """The spec of op ``name``.

    Raises:
        KeyError: no such op (names the closest registered one).
    """
    ops = {spec.name: spec for spec in registered_ops()}
    if name not in ops:
        raise KeyError(f"unknown op {name!r} (registered: {', '.join(ops)}){did_you_mean(name, ops)}")
    return ops[name]


def native_source_dirs() -> list[str]:
    """The ``csrc/`` folders of the registered ops with native backends (what the extension builder compiles)."""
    return [spec.csrc for spec in registered_ops() if spec.csrc is not None]
