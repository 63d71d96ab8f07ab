"""One lock, one location and one time limit for every JIT build: shardkit's ``shardkit_C`` and DeepSpeed's ops.

torch's ``cpp_extension.load`` guards a build folder with a *baton*: a file named ``lock`` created with
O_EXCL and removed when the build ends. A build killed mid-compile (Ctrl-C twice, an OOM kill, a test's
timeout) leaves the baton behind, and every later ``load`` of that op - even of an op already built - polls
for it to go, for ever, in silence. shardkit therefore takes its own ``fcntl`` lock (``.lock``, released by
the kernel when its holder dies, however it dies) before any build: whoever holds it knows that no shardkit
process is building, so a baton it finds belongs to a dead process and is removed.

Waiting for another live process's build and the compile itself both have a time limit
(``SHARDKIT_BUILD_WAIT_S``, ``SHARDKIT_BUILD_TIMEOUT_S``); past it the error names the folder, the
holder's pid and what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

try:
    from shardkit.utils.env import seconds_from_env
except ImportError:  # loaded by path (setup.py's ahead-of-time build runs before shardkit is installed)
    import importlib.util as _util

    _spec = _util.spec_from_file_location("_shardkit_env", Path(__file__).parents[1] / "utils" / "env.py")
    _env = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_env)
    seconds_from_env = _env.seconds_from_env

__all__ = ["BuildTimeout", "build_lock", "build_timeout_s", "clear_stale_baton", "extensions_root",
           "run_build_subprocess"]

_log = logging.getLogger("shardkit.ops")

# NOTE: the slowest build measured is DeepSpeed's async_io, ~5 min on 2 busy cores; 30 min is six times that.
_DEFAULT_TIMEOUT_S = 1800.0
_POLL_S = 0.5


class BuildTimeout(RuntimeError):
    """A build, or the wait for another process's build, ran past its time limit."""


def build_timeout_s() -> float:
    """The time limit of one compile: ``SHARDKIT_BUILD_TIMEOUT_S`` (default 1800 s)."""
    return seconds_from_env("SHARDKIT_BUILD_TIMEOUT_S", _DEFAULT_TIMEOUT_S)


def extensions_root() -> Path:
    """The one folder every JIT-built op lives under: ``$TORCH_EXTENSIONS_DIR``, else torch's default.

    torch's default is per user, Python and accelerator (``~/.cache/torch_extensions/py312_cpu``), the same
    folder DeepSpeed's ops use, so a plain ``python train.py`` finds what ``make demo`` built.
    """
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("shardkit_C", verbose=False)).parent


def clear_stale_baton(build_dir: Path) -> bool:
    """Remove torch's ``lock`` baton from ``build_dir``; call only while holding :func:`build_lock`.

    Returns True when one was there (it was left by a killed build).
    """
    baton = Path(build_dir) / "lock"
    if not baton.exists():
        return False
    _log.warning("shardkit: removing %s, left by a build that was killed (no build holds %s)", baton,
                 Path(build_dir) / ".lock")
    baton.unlink(missing_ok=True)
    return True


def _holder(lock_file) -> str:
    with contextlib.suppress(OSError, ValueError):
        lock_file.seek(0)
        pid = lock_file.read(32).strip()
        if pid.isdigit():
            return f"pid {int(pid)}"
    return "another process"


@contextlib.contextmanager
def build_lock(build_dir: Path, label: str, wait_s: float | None = None) -> Iterator[None]:
    """Hold the build lock of ``build_dir`` (waiting at most ``wait_s``) with no stale baton left inside.

    Args:
        build_dir: the op's build folder (created if missing).
        label: what is built, for messages (e.g. ``"DeepSpeed op cpu_adam"``).
        wait_s: how long to wait for another process's build; default ``SHARDKIT_BUILD_WAIT_S``, else the
            build time limit plus a minute.

    Raises:
        BuildTimeout: another process held the lock for longer than ``wait_s``.
    """
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    if wait_s is None:
        wait_s = seconds_from_env("SHARDKIT_BUILD_WAIT_S", build_timeout_s() + 60)
    with open(build_dir / ".lock", "a+") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BuildTimeout(
                        f"waited {wait_s:.0f} s for {_holder(lock)} building {label} in {build_dir} (it holds "
                        f"{build_dir / '.lock'}). If that process is stuck, end it; to wait longer set "
                        f"SHARDKIT_BUILD_WAIT_S") from None
                time.sleep(_POLL_S)
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(str(os.getpid()))
            lock.flush()
            clear_stale_baton(build_dir)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_build_subprocess(code: str, label: str, build_dir: Path, timeout_s: float | None = None) -> None:
    """Run ``python -c code`` (a build) in its own process group, killed after ``timeout_s``.

    Call while holding :func:`build_lock`. The compile runs in a child so that a hung compiler can be ended:
    on timeout the whole group (ninja, the compilers) is killed, its baton removed, and BuildTimeout raised.
    A failed build raises RuntimeError with the last lines of its output.
    """
    timeout_s = build_timeout_s() if timeout_s is None else timeout_s
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True, errors="replace")
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        clear_stale_baton(build_dir)
        raise BuildTimeout(f"building {label} did not finish in {timeout_s:.0f} s and was stopped (build folder "
                           f"{build_dir}). A slow machine may need more: set SHARDKIT_BUILD_TIMEOUT_S") from None
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        clear_stale_baton(build_dir)
        raise
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise RuntimeError(f"building {label} failed (exit code {proc.returncode}; build folder {build_dir}):\n"
                           f"{tail}")
