"""Publishing a checkpoint directory: the parent's lock, the renames, `latest`, pruning and crash recovery.

The protocol (rank 0, holding ``parent/.shardkit.lock`` throughout): repair leftovers of killed saves,
write everything into ``.<name>.tmp-<id>``, write the manifest last, move an existing ``<name>`` to
``.<name>.old``, rename the temporary directory to ``<name>``, delete the old copy, move ``latest``,
prune. A kill at any step leaves either the previous or the new checkpoint whole and loadable; the next
save (or load) finds it. :data:`FAULT_STEPS` names every step for the crash tests.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import signal
from pathlib import Path

from .format import FORMAT_NAME, LATEST, MANIFEST, CheckpointError, fsync_dir, write_bytes_durable
from .reader import hidden_copies, old_name, tmp_prefix
from .schema import read_latest

__all__ = [
    "FAULT_ENV",
    "FAULT_STEPS",
    "CheckpointBusyError",
    "acquire_lock",
    "release_lock",
    "fault_point",
    "prune_checkpoints",
    "recover_checkpoints",
    "rename_into_place",
    "update_latest",
]

_LOCK = ".shardkit.lock"
# Hidden leftovers of a save of <name>; the bare ".tmp" is what earlier versions of the writer used.
_HIDDEN_RE = re.compile(r"^\.(?P<name>.+)\.(?:tmp-[0-9a-f]+|tmp|old|saving)$")

# Fault injection for the crash tests: SHARDKIT_CHECKPOINT_FAULT=<step> SIGKILLs the process when rank 0
# (or any rank, for the per-rank steps) reaches <step>; "<step>:stop" SIGSTOPs it instead, once, so a test
# can run a second save while the first one is parked at a known point.
FAULT_ENV = "SHARDKIT_CHECKPOINT_FAULT"
FAULT_STEPS = ("locked", "recovered", "tmp-created", "file-written", "part-written", "manifest-written",
               "tmp-sealed", "old-moved", "renamed", "old-removed", "latest-written", "latest-moved",
               "prune-renamed", "pruned")


class CheckpointBusyError(CheckpointError):
    """Another save into the same parent directory holds its lock; this save did nothing."""


def fault_point(step: str) -> None:
    """Kills (or stops) this process at ``step`` when ``SHARDKIT_CHECKPOINT_FAULT`` names it."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, _, action = spec.partition(":")
    if want != step:
        return
    if action == "stop":
        del os.environ[FAULT_ENV]  # once: after SIGCONT the save runs to its end
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def acquire_lock(parent: Path, path: Path) -> int:
    """An exclusive, non-blocking flock on ``parent/.shardkit.lock``; the kernel drops it when we die.

    The file is removed again by :func:`release_lock` after a clean save, so no run folder keeps it. A
    process that opened the file just before its holder removed it locks an orphan: it sees that the path
    no longer leads to its file and opens the new one instead.
    """
    for _ in range(8):
        fd = os.open(parent / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointBusyError(
                f"{path}: another save into {parent} is in progress (process {holder} holds {parent / _LOCK}); "
                "this save did nothing. Save from one process at a time, or to another directory") from None
        if _same_file(fd, parent / _LOCK):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}@{os.uname().nodename}".encode(), 0)
            return fd
        os.close(fd)  # the previous holder removed the file between our open and our lock: take the new one
    raise CheckpointBusyError(f"{path}: the lock {parent / _LOCK} kept changing under this save; another process "
                              "is saving into the same directory")


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def release_lock(parent: Path, fd: int) -> None:
    """Removes ``parent/.shardkit.lock`` (while still holding it, when it is still ours) and drops the lock."""
    try:
        if _same_file(fd, parent / _LOCK):
            os.unlink(parent / _LOCK)
    except OSError:
        pass  # a lock file left behind is harmless: the next save reuses it
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def recover_checkpoints(parent: str | os.PathLike) -> list[Path]:
    """Repairs what killed saves left in ``parent``; call only while holding its lock (the writer does).

    A checkpoint whose directory is missing while ``latest`` names it or its old copy survives (a kill
    between the two renames of a save over an existing name) gets back its newest complete hidden copy.
    Every other hidden leftover (unfinished ``.tmp-*`` directories, old copies, half-pruned
    ``.deleting`` directories, stale pointers) is removed. Returns the checkpoints restored.
    """
    parent = Path(parent)
    try:
        latest = read_latest(parent) if (parent / LATEST).is_file() else None
    except CheckpointError:
        latest = None
    names: set[str] = set()
    for d in parent.iterdir():
        if d.name == f".{LATEST}.tmp":
            d.unlink(missing_ok=True)
        elif d.name.endswith(".deleting") and d.name.startswith("."):
            shutil.rmtree(d, ignore_errors=True)
        elif m := _HIDDEN_RE.match(d.name):
            names.add(m.group("name"))
    restored = []
    for name in sorted(names):
        target = parent / name
        if not target.exists() and (name == latest or (parent / old_name(name)).is_dir()):
            copies = hidden_copies(parent, name)
            if copies:
                os.rename(copies[0], target)
                fsync_dir(parent)
                restored.append(target)
        for d in parent.glob(f"{glob.escape(tmp_prefix(name))}*"):
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(parent / old_name(name), ignore_errors=True)
        shutil.rmtree(parent / f".{name}.tmp", ignore_errors=True)
        (parent / f".{name}.saving").unlink(missing_ok=True)
    if names:
        fsync_dir(parent)
    return restored


def rename_into_place(tmp: Path, path: Path) -> None:
    """Renames ``tmp`` to ``path``; an existing ``path`` is moved aside first and removed afterwards.

    A kill between the two renames leaves ``path`` missing with both copies whole: readers and the next
    save (:func:`recover_checkpoints`) take the new one.
    """
    old = path.parent / old_name(path.name)
    if old.exists():  # only when recovery could not run; never delete it while `path` is missing
        if not (path / MANIFEST).is_file():
            os.rename(old, path)
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
        fault_point("old-moved")
    os.rename(tmp, path)
    fsync_dir(path.parent)
    fault_point("renamed")
    if old.exists():
        shutil.rmtree(old)
        fault_point("old-removed")


def update_latest(path: Path) -> None:
    """Points ``path.parent/latest`` at ``path`` atomically (temp file, fsync, rename, fsync dir)."""
    tmp = path.parent / f".{LATEST}.tmp"
    write_bytes_durable(tmp, (path.name + "\n").encode())
    fault_point("latest-written")
    os.replace(tmp, path.parent / LATEST)
    fsync_dir(path.parent)
    fault_point("latest-moved")


def prune_checkpoints(parent: Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Removes all but the ``keep_last`` newest shardkit checkpoints in ``parent``; returns those removed.

    Only directories whose ``shardkit.json`` names the shardkit format count; ``keep`` and the target
    of ``latest`` are never removed. Each victim is renamed to a hidden name before deletion so that
    a crash mid-delete never leaves a half checkpoint that looks whole.
    """
    found = []
    for d in parent.iterdir():
        if d.name.startswith(".") or not d.is_dir() or d.is_symlink():
            continue
        try:
            m = json.loads((d / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        created = m.get("created", 0.0) if isinstance(m, dict) else None
        if isinstance(m, dict) and m.get("format") == FORMAT_NAME and isinstance(created, (int, float)):
            found.append((float(created), d.name, d))
    found.sort(reverse=True)
    protected = {keep.resolve()} if keep is not None else set()
    try:
        protected.add((parent / read_latest(parent)).resolve())
    except CheckpointError:
        pass
    removed = []
    for _, _, d in found[keep_last:]:
        if d.resolve() in protected:
            continue
        doomed = parent / f".{d.name}.deleting"
        if doomed.exists():
            shutil.rmtree(doomed)
        os.rename(d, doomed)
        fault_point("prune-renamed")
        shutil.rmtree(doomed)
        removed.append(d)
    if removed:
        fsync_dir(parent)
        fault_point("pruned")
    return removed
