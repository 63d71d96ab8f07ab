"""One builder for the C++/CUDA extension ``shardkit_C``: JIT on first use and ahead of time in setup.py.

The folders compiled are the ones the registered ops name (``OpSpec.csrc``: ``shardkit.ops.registry.register``
hands each to :func:`add_op_dir`);
every ``csrc/<op>/<op>.cpp`` is one source of ONE shared library that registers its raw kernels in the
torch op namespace ``shardkit_C`` (``TORCH_LIBRARY_FRAGMENT``). The library has no Python module init:
it is loaded with ``torch.ops.load_library`` and used through ``torch.ops.shardkit_C.<kernel>``.

JIT: ``torch.utils.cpp_extension.load`` with ninja, cached under ``TORCH_EXTENSIONS_DIR`` (else a folder per
environment in torch's per-user cache, the folder DeepSpeed's ops use too: :func:`shardkit.ops.build_lock.
extensions_root`). Under a launcher the process with LOCAL_RANK (else RANK) 0 builds while the others wait on a
marker file and the shared build lock (:mod:`shardkit.ops.build_lock`: a killed build's stale baton is cleared, the
compile runs in a supervised child under a time limit and ends with its process), so N ranks never compile N
times. A failed or impossible build warns once with the reason and the fix, is cached for the process, and dispatch
falls back to the next backend.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

if __package__:
    from .build_lock import (
        BuildStopped,
        BuildTimeout,
        build_lock,
        build_timeout_s,
        environment_ninja,
        extensions_root,
        run_build_subprocess,
        seconds_from_env,
    )
else:  # loaded by path (setup.py, scripts/check_cuda_link.py): its sibling by path too (it imports nothing of ours)
    import importlib.util as _util

    _spec = _util.spec_from_file_location("_shardkit_build_lock", Path(__file__).with_name("build_lock.py"))
    _lock_module = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_lock_module)
    build_lock, extensions_root = _lock_module.build_lock, _lock_module.extensions_root
    environment_ninja = _lock_module.environment_ninja
    run_build_subprocess, build_timeout_s = _lock_module.run_build_subprocess, _lock_module.build_timeout_s
    seconds_from_env = _lock_module.seconds_from_env
    BuildStopped, BuildTimeout = _lock_module.BuildStopped, _lock_module.BuildTimeout

__all__ = ["BUILDER", "CSRC_PLACES", "ExtensionBuilder", "ExtensionUnavailable", "add_op_dir", "find_csrc"]

_log = logging.getLogger("shardkit.ops")

_REPO = Path(__file__).resolve().parents[2]
# Where the C++/CUDA sources are, first found wins: the package data of an installed wheel (setup.py ships csrc/
# as shardkit/ops/csrc), then the source checkout's csrc/ (editable install, scripts/build_ops.py, setup.py).
CSRC_PLACES = (Path(__file__).resolve().with_name("csrc"), _REPO / "csrc")
_NAME = "shardkit_C"
# NOTE: measured on a 2-core machine: 3 sources built in 16 s (~10 s per translation unit with the slim ATen
# headers we include, ninja running two at once); reported in the one log line so the pause is expected.
_SECONDS_PER_SOURCE = 6


class ExtensionUnavailable(RuntimeError):
    """The extension could not be built or loaded; the message names the reason and the fix."""


def find_csrc(places: Iterable[Path] = CSRC_PLACES) -> Path | None:
    """The first of ``places`` that holds the sources (an ``include/`` folder), or None when none does."""
    return next((Path(p) for p in places if (Path(p) / "include").is_dir()), None)


def _rank() -> int:
    for key in ("LOCAL_RANK", "RANK"):
        value = os.environ.get(key)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return 0


# The csrc/ folders of the registered ops, in registration order: `shardkit.ops.registry.register` adds each op's
# folder here, so that this module, below the registry and dispatch, needs no import of them. Importing any module of
# shardkit.ops runs the package first, which registers the built-in ops before anything can build.
_REGISTERED_OP_DIRS: list[str] = []


def add_op_dir(name: str) -> None:
    """Compile ``csrc/<name>/`` into :data:`BUILDER`'s library (``OpSpec.csrc`` of an op being registered)."""
    if name not in _REGISTERED_OP_DIRS:
        _REGISTERED_OP_DIRS.append(name)


def _write_marker(marker: Path, text: str) -> None:
    """Write the build marker whole or not at all (a kill mid-write leaves no half marker), the only one there: an
    older marker would vouch for a library since rebuilt from other sources."""
    for old in marker.parent.glob(".built-*"):
        if old != marker:
            old.unlink(missing_ok=True)
    partial = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    os.replace(partial, marker)


class ExtensionBuilder:
    """Builds, caches and loads the ``shardkit_C`` library (see the module docstring).

    Args:
        csrc: the folder holding ``<op>/<op>.cpp`` sources and ``include/``; None: the first of
            :data:`CSRC_PLACES` that has them (the installed package's, then the checkout's).
        name: the library name (also the torch op namespace of the raw kernels).
        op_dirs: returns the ``csrc/`` folders to compile (for :data:`BUILDER`: the registered ops'); None
            compiles every folder but ``include/`` and ``tests/``.
    """

    def __init__(self, csrc: Path | None = None, name: str = _NAME,
                 op_dirs: Callable[[], Iterable[str]] | None = None) -> None:
        self.searched = (Path(csrc),) if csrc is not None else CSRC_PLACES
        self.csrc = find_csrc(self.searched) or self.searched[0]
        self.name = name
        self._op_dirs = op_dirs
        self._loaded: str | None = None
        self._failure: str | None = None

    # ---------------------------------------------------------------- sources and flags
    @staticmethod
    def with_cuda() -> bool:
        """True when this torch is a CUDA build and a CUDA toolkit (CUDA_HOME) exists."""
        from torch.utils.cpp_extension import CUDA_HOME

        return bool(torch.version.cuda) and CUDA_HOME is not None

    def op_dirs(self) -> list[Path]:
        """The op folders compiled, sorted. Raises FileNotFoundError for a registered folder that does not exist."""
        if self._op_dirs is None:
            return sorted(p for p in self.csrc.iterdir() if p.is_dir() and p.name not in ("include", "tests"))
        dirs = sorted(self.csrc / name for name in self._op_dirs())
        missing = [str(d) for d in dirs if not d.is_dir()]
        if missing:
            raise FileNotFoundError(f"registered ops name C++ source folders that do not exist: {missing}; fix the "
                                    "op's OpSpec(csrc=...) or add the folder")
        return dirs

    def sources(self, cuda: bool | None = None) -> list[str]:
        """``<op>/*.cpp`` (CPU kernels + bindings), plus ``*.cu`` and ``*_cuda_binding.cpp`` with CUDA."""
        cuda = self.with_cuda() if cuda is None else cuda
        dirs = self.op_dirs() if self.csrc.is_dir() else []
        found = []
        for path in sorted(p for d in dirs for p in d.glob("*.cpp")) + sorted(p for d in dirs for p in d.glob("*.cu")):
            is_cuda = path.suffix == ".cu" or path.stem.endswith("_cuda_binding")
            if is_cuda and not cuda:
                continue
            found.append(str(path))
        return found

    def include_dirs(self) -> list[str]:
        return [str(self.csrc / "include")]

    def cflags(self, aot: bool = False) -> list[str]:
        """-O3 and OpenMP; ``-march=native`` only for JIT, since an AOT wheel must run on other CPUs.

        ``-fno-math-errno``: no kernel reads errno, and without it GCC will not vectorise a loop that calls sqrt.
        """
        flags = ["-O3", "-fno-math-errno", "-fopenmp", "-DSHARDKIT_WITH_TORCH"]
        if not aot:
            flags.append("-march=native")
        if self.with_cuda():
            flags.append("-DSHARDKIT_WITH_CUDA")
        return flags

    def cuda_cflags(self) -> list[str]:
        # NOTE: no --use_fast_math: it swaps expf/logf/tanhf for approximations, and on an H100 the fused
        # cross-entropy's fp32 gradients came out ~50x further from fp64 than torch's (1.2e-5 vs 2.3e-7). The
        # kernels are memory-bound; where an approximation is safe it is written out (swiglu's __expf).
        return ["-O3", "-DSHARDKIT_WITH_CUDA"]

    def ldflags(self) -> list[str]:
        return ["-fopenmp"]

    def build_root(self) -> Path:
        return extensions_root() / self.name

    def fingerprint(self) -> str:
        """Hash of the sources, headers, flags and torch version: the build marker's key."""
        digest = hashlib.sha256(f"{torch.__version__}|{self.cflags()}|{self.with_cuda()}".encode())
        files = self.sources() + sorted(str(p) for p in (self.csrc / "include").rglob("*.h"))
        files += sorted(str(p) for p in self.csrc.glob("*/*.h"))
        for path in files:
            digest.update(path.encode())
            digest.update(Path(path).read_bytes())
        return digest.hexdigest()[:16]

    # ---------------------------------------------------------------- preflight
    def _preflight(self) -> str | None:
        """Cheap checks that make a build impossible; returns 'reason. fix' or None."""
        from torch.utils.cpp_extension import is_ninja_available

        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            return (f"C++ compiler {cxx!r} not found (from $CXX, default 'c++'). "
                    "Install g++ (apt-get install g++) or point CXX at a working compiler")
        with environment_ninja():  # the ninja the build will run (run_build_subprocess)
            has_ninja = is_ninja_available()
        if not has_ninja:
            return "ninja not found. Install it with `pip install ninja` in this environment"
        if not self.sources(cuda=False):
            where = " or ".join(str(p) for p in self.searched)
            return (f"no C++ sources under {where}. Reinstall shardkit (its wheel ships them as shardkit/ops/csrc) "
                    "or install it from a source checkout (pip install -e .)")
        return None

    # ---------------------------------------------------------------- loading
    def _aot_library(self) -> Path | None:
        """The library built by ``SHARDKIT_BUILD_OPS=1 pip install`` (sdk/ops/_C*.so), if any."""
        here = Path(__file__).resolve().parent
        found = sorted(here.glob("_C*.so"))
        return found[0] if found else None

    def load(self) -> str:
        """Return the loaded library path, building it on first use. Raises ExtensionUnavailable."""
        if self._loaded is not None:
            return self._loaded
        if self._failure is not None:
            raise ExtensionUnavailable(self._failure)
        try:
            self._loaded = self._load_uncached()
        except Exception as exc:  # noqa: BLE001 - any build error becomes one warning and a fallback
            reason = str(exc).strip().splitlines()
            short = reason[-1] if reason else type(exc).__name__
            if not isinstance(exc, ExtensionUnavailable):
                short = (f"compiling {self.name} failed ({type(exc).__name__}: {short[:300]}). "
                         f"Rerun with SHARDKIT_BUILD_VERBOSE=1 to see the compiler output, or build log in "
                         f"{self.build_root()}")
            self._failure = short
            warnings.warn(f"shardkit: C++ ops unavailable, falling back to the next backend: {short}",
                          RuntimeWarning, stacklevel=3)
            raise ExtensionUnavailable(short) from exc
        return self._loaded

    def available(self) -> bool:
        """True when the library is loaded or can be built; never raises."""
        try:
            self.load()
        except ExtensionUnavailable:
            return False
        return True

    def reset(self) -> None:
        """Forget a cached failure (tests; after installing a compiler)."""
        self._failure = None

    def _load_uncached(self) -> str:
        if os.environ.get("SHARDKIT_DISABLE_CPP") == "1":
            raise ExtensionUnavailable("disabled by SHARDKIT_DISABLE_CPP=1. Unset it to use the C++ ops")
        aot = self._aot_library()
        if aot is not None:
            torch.ops.load_library(str(aot))
            return str(aot)
        problem = self._preflight()
        if problem is not None:
            raise ExtensionUnavailable(problem)
        return self._jit_build()

    def _jit_build(self) -> str:
        build_dir = self.build_root()
        build_dir.mkdir(parents=True, exist_ok=True)
        marker = build_dir / f".built-{self.fingerprint()}"
        rank = _rank()
        if rank != 0 and not marker.exists():
            # NOTE: wait for rank 0's marker instead of competing for the lock, so that rank 0 is the one
            # that compiles and prints; a lone non-zero rank gives up waiting after SHARDKIT_BUILD_WAIT_S.
            deadline = time.monotonic() + seconds_from_env("SHARDKIT_BUILD_WAIT_S", build_timeout_s() + 60)
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.5)
        with build_lock(build_dir, f"shardkit's C++ ops ({self.name})"):
            if marker.exists() and marker.read_text().startswith("fail:"):
                raise ExtensionUnavailable(marker.read_text()[5:].strip())
            return self._compile_locked(build_dir, marker, verbose_rank=rank == 0)

    def _compile_locked(self, build_dir: Path, marker: Path, verbose_rank: bool) -> str:
        sources = self.sources()
        verbose = verbose_rank and os.environ.get("SHARDKIT_BUILD_VERBOSE") == "1"
        cuda = self.with_cuda()
        kwargs = dict(name=self.name, sources=sources, extra_cflags=self.cflags(), extra_ldflags=self.ldflags(),
                      extra_cuda_cflags=self.cuda_cflags() if cuda else None,
                      extra_include_paths=self.include_dirs(), build_directory=str(build_dir), verbose=verbose,
                      with_cuda=cuda, is_python_module=False)
        library = build_dir / f"{self.name}.so"
        try:
            if not (library.exists() and marker.exists() and marker.read_text() == "ok"):
                if verbose_rank:
                    _log.warning("shardkit: building C++ ops into %s (first use, ~%d s)...", build_dir,
                                 _SECONDS_PER_SOURCE * len(sources))
                # NOTE: the compile runs in a child, under the build supervisor: it has a time limit (a hung compiler
                # is killed) and it ends with this process (a killed job leaves no compile running). Whatever a
                # killed build left half-written, ninja redoes: an output its log does not record is out of date.
                run_build_subprocess(f"from torch.utils.cpp_extension import load; load(**{kwargs!r})",
                                     f"shardkit's C++ ops ({self.name})", build_dir)
            torch.ops.load_library(str(library))
        except Exception as exc:
            if verbose_rank and not isinstance(exc, (BuildStopped, BuildTimeout)):  # a rerun may pass: no verdict
                _write_marker(marker, f"fail: compile error ({type(exc).__name__}); see {build_dir}")
            raise
        _write_marker(marker, "ok")
        return str(library)

    # ---------------------------------------------------------------- ahead of time (setup.py)
    def aot_extension(self):
        """The setuptools Extension for ``SHARDKIT_BUILD_OPS=1`` (portable flags: no -march=native)."""
        from torch.utils.cpp_extension import CppExtension, CUDAExtension

        cuda = self.with_cuda()
        sources = [os.path.relpath(s, _REPO) for s in self.sources(cuda)]
        kwargs = dict(include_dirs=self.include_dirs(), extra_link_args=self.ldflags())
        if cuda:
            kwargs["extra_compile_args"] = {"cxx": self.cflags(aot=True), "nvcc": self.cuda_cflags()}
            return CUDAExtension("shardkit.ops._C", sources, **kwargs)
        kwargs["extra_compile_args"] = {"cxx": self.cflags(aot=True)}
        return CppExtension("shardkit.ops._C", sources, **kwargs)


# NOTE: loaded by path (setup.py, scripts/check_cuda_link.py) this file has no package, hence no registry: those
# build every folder of csrc/ (tests/kernels/test_builder.py checks that the folders are exactly the registered ones).
BUILDER = ExtensionBuilder(op_dirs=_REGISTERED_OP_DIRS.copy if __package__ else None)

if __name__ == "__main__":  # `python -m shardkit.ops._builder` builds (or explains why not) and exits
    logging.basicConfig(level=logging.INFO)
    print(BUILDER.load() if BUILDER.available() else "unavailable", file=sys.stderr)
