"""One lock, one location and one time limit for every JIT build: shardkit's ``shardkit_C`` and DeepSpeed's ops.

torch's ``cpp_extension.load`` guards a build folder with a *baton*: a file named ``lock`` created with
O_EXCL and removed when the build ends. A build killed mid-compile (Ctrl-C twice, an OOM kill, a test's
timeout) leaves the baton behind, and every later ``load`` of that op - even of an op already built - polls
for it to go, for ever, in silence. shardkit therefore takes its own ``fcntl`` lock (``.lock``, released by
the kernel when its last holder dies, however it dies) before any build: whoever holds it knows that no
shardkit process is building, so a baton it finds belongs to a dead process and is removed.

The compile itself runs under a supervisor (``_build_supervisor.py``) that ends the whole build - ninja and
every compiler - when the process that asked for it dies, and that holds the lock with every build process
(the lock's file is their stdin): a killed job never leaves a compile running beside the next job's.

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
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

try:
    from shardkit.utils.env import seconds_from_env
except ImportError:  # loaded by path (setup.py's ahead-of-time build runs before shardkit is installed)
    import importlib.util as _util

    _spec = _util.spec_from_file_location("_shardkit_env", Path(__file__).parents[1] / "utils" / "env.py")
    _env = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_env)
    seconds_from_env = _env.seconds_from_env

__all__ = ["BuildStopped", "BuildTimeout", "build_lock", "build_timeout_s", "clear_stale_baton", "environment_ninja",
           "default_extensions_root", "extensions_root", "run_build_subprocess"]

_log = logging.getLogger("shardkit.ops")

# NOTE: the slowest build measured is DeepSpeed's async_io, ~5 min on 2 busy cores; 30 min is six times that.
_DEFAULT_TIMEOUT_S = 1800.0
_POLL_S = 0.5
_SUPERVISOR = Path(__file__).resolve().with_name("_build_supervisor.py")
_EXIT_TIMEOUT = 124  # the supervisor's exit code when the build ran past its time limit
# build folder (resolved) -> (thread, open lock file) while a thread of this process holds that folder's build lock
_HELD: dict[str, tuple[int, IO[str]]] = {}


class BuildTimeout(RuntimeError):
    """A build, or the wait for another process's build, ran past its time limit."""


class BuildStopped(RuntimeError):
    """A build was ended by a signal (stopped, killed, a compiler killed): not a compile error, a rerun may pass."""


def build_timeout_s() -> float:
    """The time limit of one compile: ``SHARDKIT_BUILD_TIMEOUT_S`` (default 1800 s)."""
    return seconds_from_env("SHARDKIT_BUILD_TIMEOUT_S", _DEFAULT_TIMEOUT_S)


def default_extensions_root(prefix: str | None = None) -> Path:
    """torch's default folder for this user, Python and accelerator, made one per environment and torch version.

    torch's own default (``~/.cache/torch_extensions/py311_cpu``) is shared by every virtual environment of the
    user: two environments (another torch, another DeepSpeed) rebuild each other's ops in turn, and load what
    the other built. Hence ``py311_cpu-torch2.13.0-<hash of sys.prefix and torch's version>`` beside it.
    """
    import hashlib

    import torch
    from torch.utils.cpp_extension import get_default_build_root

    # torch's folder name (cpp_extension._get_build_directory, which would also create its folder)
    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    prefix = os.path.realpath(sys.prefix if prefix is None else prefix)
    key = hashlib.sha256(f"{prefix}|{torch.__version__}".encode()).hexdigest()[:10]
    return Path(get_default_build_root()) / f"{python}_{accelerator}-torch{torch.__version__.split('+')[0]}-{key}"


def extensions_root() -> Path:
    """The one folder every JIT-built op lives under: ``$TORCH_EXTENSIONS_DIR``, else :func:`default_extensions_root`.

    When unset, TORCH_EXTENSIONS_DIR is set to the default in this process, so that DeepSpeed's op loads (which read
    it through torch) and the processes this one starts use the very folder shardkit locks and builds in.
    """
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    root = default_extensions_root()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)
    return root


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
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:  # its build processes hold the lock still: they end with their compile
                return f"the build that pid {int(pid)} (now exited) started"
            except OSError:
                pass
            return f"pid {int(pid)}"
    return "another process"


@contextlib.contextmanager
def build_lock(build_dir: Path, label: str, wait_s: float | None = None) -> Iterator[None]:
    """Hold the build lock of ``build_dir`` (waiting at most ``wait_s``) with no stale baton left inside.

    The lock is never released explicitly: it goes when its file is closed by the last process holding it, this one
    and the build processes :func:`run_build_subprocess` handed it to.

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
    key = str(build_dir.resolve())
    if _HELD.get(key, (None,))[0] == threading.get_ident():  # held here already: a second flock would wait for itself
        yield
        return
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
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        clear_stale_baton(build_dir)
        _HELD[key] = (threading.get_ident(), lock)
        try:
            yield
        finally:
            del _HELD[key]


@contextlib.contextmanager
def environment_ninja() -> Iterator[None]:
    """Inside the block, PATH finds this Python environment's ninja (the package's ``ninja`` dependency) first.

    torch's JIT build runs whichever ``ninja`` PATH finds, and ninja keeps in the folder's ``.ninja_log`` a hash of
    every command it ran. ninja releases hash differently (the system's 1.11 and the ``ninja`` wheel's 1.13 do), so
    a folder built by one looks changed to the other and every object is compiled again: minutes for DeepSpeed's
    cpu_adam and async_io, inside whatever run loaded the op next. Whether PATH held the environment's ``bin`` (an
    activated environment) or not (``.venv/bin/python`` as `make test` runs it) must not decide that. Without a
    ``ninja`` in the environment, PATH is left as it is.
    """
    scripts = sysconfig.get_path("scripts")
    ninja = os.path.join(scripts or "", "ninja")
    if not (scripts and os.path.isfile(ninja) and os.access(ninja, os.X_OK)):
        yield
        return
    path = os.environ.get("PATH")
    os.environ["PATH"] = scripts + os.pathsep + path if path else scripts
    try:
        yield
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path


def ninja_has_work(build_dir: Path) -> bool:
    """Whether ninja, run in ``build_dir`` as a JIT load runs it (this environment's ninja), would compile anything:
    a dry run, milliseconds. A folder copied without its times (``cp -r``), or last built by another ninja, holds a
    library and its marker yet is out of date to ninja, and the load that finds it would compile everything again
    in the loading process, outside the supervisor (no time limit; a killed job leaves the compile running). True
    also when the folder has no ``build.ninja`` or ninja cannot say; False only when ninja says there is no work, or
    there is no ninja at all (the load names that itself)."""
    import shutil

    if not (Path(build_dir) / "build.ninja").is_file():
        return True
    with environment_ninja():
        ninja = shutil.which("ninja")
    if ninja is None:
        return False
    try:
        dry = subprocess.run([ninja, "-n", "-C", str(build_dir)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return True
    return dry.returncode != 0 or "no work to do" not in dry.stdout


def run_build_subprocess(code: str, label: str, build_dir: Path, timeout_s: float | None = None) -> None:
    """Run ``python -c code`` (a build) under the build supervisor, holding ``build_dir``'s build lock.

    The compile runs in a child so that it can be ended: a hung compiler after ``timeout_s`` (BuildTimeout), the
    whole build when this process is killed (the supervisor sees its parent go). The child and every process of
    the build hold the lock too (the lock's file is their stdin), so the lock is free only when all of them are
    gone: a next build never shares the folder with a compile left running. A failed build raises RuntimeError with
    the last lines of its output, one ended by a signal BuildStopped (no verdict on the sources: a rerun may pass).
    Takes the lock if the caller does not hold it yet.
    """
    timeout_s = build_timeout_s() if timeout_s is None else timeout_s
    with build_lock(build_dir, label), environment_ninja():
        lock = _HELD[str(Path(build_dir).resolve())][1]
        command = [sys.executable, str(_SUPERVISOR), str(os.getpid()), repr(timeout_s), sys.executable, "-c", code]
        proc = subprocess.Popen(command, stdin=lock, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True, errors="replace")
        try:
            # NOTE: the supervisor enforces timeout_s; this one is a backstop should the supervisor itself hang
            output, _ = proc.communicate(timeout=timeout_s + 60)
        except BaseException:
            _stop(proc)
            clear_stale_baton(build_dir)
            raise
        if proc.returncode == _EXIT_TIMEOUT:
            clear_stale_baton(build_dir)
            raise BuildTimeout(f"building {label} did not finish in {timeout_s:.0f} s and was stopped (build folder "
                               f"{build_dir}). A slow machine may need more: set SHARDKIT_BUILD_TIMEOUT_S")
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        # killed (negative: the supervisor itself; above 128: a build process), or gcc's words for a killed cc1plus
        stopped = not 0 < proc.returncode <= 128 or "signal terminated program" in output
        raise (BuildStopped if stopped else RuntimeError)(
            f"building {label} {'was stopped' if stopped else 'failed'} (exit code {proc.returncode}; build folder "
            f"{build_dir}):\n{tail}")


def _stop(proc: subprocess.Popen) -> None:
    """Ask the supervisor to end its build (it ends every process of it), then make sure."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
