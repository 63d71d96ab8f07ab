"""The rules every reader of checkpoint files follows, in one place.

shardkit manifests, Hugging Face ``model.safetensors.index.json`` files and DeepSpeed tag directories
are all hostile input: a file may name ``../elsewhere``, be a symlink or a FIFO, hold gigabytes where
a few bytes were expected, or carry objects whose ``repr`` never ends. Every reader goes through:

* :func:`member_path`: a name a file gives must be a plain child of its directory (no ``/``, no
  ``..``, no absolute path, no leading dot) and not a symlink;
* :func:`open_regular`: opened without following a symlink, without blocking on a FIFO, and checked to
  be a regular file (of the expected size, when one is known) on the descriptor that is then read;
* :func:`read_small_file` / :func:`read_json_file`: at most ``limit`` bytes, UTF-8, JSON;
* :func:`describe`: what an error message may say about an untrusted value (bounded, never a full
  ``repr`` of a container);
* :func:`check_cast`: the only dtype changes a load makes (fp32 <-> fp16/bf16).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError

__all__ = [
    "CASTS",
    "NAME_RE",
    "check_cast",
    "check_child_dir",
    "describe",
    "member_path",
    "open_regular",
    "read_json_file",
    "read_small_file",
]

# The names writers produce (directories, entries and files): no separators, no leading dot.
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_CORRUPT = "the checkpoint is corrupt or was edited; restore it from a copy or save it again"

# The only dtype changes a load makes: between fp32 and a 16-bit float, the casts mixed precision needs
# (ZeRO stores fp32 masters of bf16 parameters; a bf16 save loads into an fp32 model). Anything else
# (int64 data in a float parameter, bool, fp64, fp16 <-> bf16) is refused rather than silently converted.
CASTS = frozenset({(torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                   (torch.float16, torch.float32), (torch.bfloat16, torch.float32)})


def describe(value: Any, limit: int = 60) -> str:
    """A bounded description of an untrusted value for an error message.

    Strings and small numbers are shown (cut at ``limit`` characters); anything else only by its type
    and length: formatting a crafted container (a list holding itself a billion times by reference)
    would take hours and gigabytes, and ``repr`` of an int past 4300 digits raises.
    """
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        text = repr(value[:limit])
        return text if len(value) <= limit else f"{text[:-1]}...{text[-1]} ({len(value)} characters)"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    if type(value) in (list, tuple) and len(value) <= 8 and all(_scalar(x) for x in value):
        inner = ", ".join(describe(x, 20) for x in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    try:
        n = len(value)
    except Exception:  # noqa: BLE001 - a foreign __len__ may raise anything; the type is enough
        return f"a {type(value).__name__}"
    return f"a {type(value).__name__} of {n} items"


def _scalar(v: Any) -> bool:
    return v is None or type(v) in (bool, int, float, str)


def member_path(directory: Path, name: Any, where: str) -> Path:
    """``directory / name`` after checking that ``name`` is a plain child name and not a symlink.

    Writers make no symlinks; one that resolves outside the directory would load foreign data, one
    inside would let two names alias one file.

    Raises:
        CheckpointError: naming ``where`` (the file and field that gave the name).
    """
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise CheckpointError(f"{where}: {describe(name, 80)} is not a plain file name inside {directory} (no '/', "
                              f"'..', absolute path or leading dot); {_CORRUPT}")
    p = directory / name
    if p.is_symlink():
        target = p.resolve()
        inside = "inside the directory" if target.parent == directory.resolve() else "outside the directory"
        raise CheckpointError(f"{where}: {p} is a symlink to {target}, {inside}; the files must be regular files "
                              "in the directory itself, refusing it")
    return p


def check_child_dir(parent: Path, name: Any, where: str) -> Path:
    """``parent / name`` for a pointer (``latest``, a tag) that must name a directory next to it.

    A symlinked directory is accepted only when it resolves to a child of ``parent``.
    """
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise CheckpointError(f"{where}: holds {describe(name, 80)}, but it may only name a checkpoint directory "
                              f"next to it (no '/', '..', absolute path or leading dot); fix or delete it")
    cand = parent / name
    if cand.is_symlink() and cand.resolve().parent != parent.resolve():
        raise CheckpointError(f"{where}: names {name!r}, a symlink to {cand.resolve()} outside {parent}; "
                              "refusing to follow it")
    return cand


def open_regular(path: Path, what: str, size: int | None = None) -> int:
    """A read-only descriptor of ``path``: never through a symlink, never blocking on a FIFO.

    The checks run on the descriptor itself (``fstat``), so a file swapped after the check is not the
    one read. With ``size`` the file must have exactly that many bytes (the manifest's record).

    Raises:
        CheckpointError: naming the file: missing, a symlink, not a regular file, or of the wrong size.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} is missing") from None
    except OSError as e:
        why = "it is a symlink" if os.path.islink(path) else e.strerror
        raise CheckpointError(f"{path}: {what} cannot be opened ({why}); it must be a regular file") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: {what} is not a regular file (a FIFO, device or directory is never read)")
    if size is not None and st.st_size != size:
        os.close(fd)
        raise CheckpointError(f"{path}: is {st.st_size} bytes but the manifest says {size}: the file is "
                              f"{'truncated' if st.st_size < size else 'overwritten'}")
    os.set_blocking(fd, True)
    return fd


def read_small_file(path: Path, limit: int, what: str) -> bytes:
    """Reads a regular, non-symlink file of at most ``limit`` bytes (a FIFO or /dev/zero would hang or fill
    memory)."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(fd).st_size > limit:
            raise CheckpointError(f"{path}: {what} must be a regular file of at most {limit} bytes")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew since the fstat
        raise CheckpointError(f"{path}: {what} must be a regular file of at most {limit} bytes")
    return data


def read_json_file(path: Path, limit: int, what: str) -> Any:
    """A small file parsed as UTF-8 JSON; every failure is a :class:`CheckpointError` naming the file."""
    raw = read_small_file(path, limit, what)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({str(e)[:200]})") from None


def check_cast(stored: torch.dtype, live: torch.dtype, where: str, key: str) -> None:
    """Refuses loading a tensor stored as ``stored`` into one of dtype ``live`` unless equal or fp32 <-> 16-bit.

    Raises:
        CheckpointError: naming ``where``, the key and both dtypes.
    """
    if stored != live and (stored, live) not in CASTS:
        raise CheckpointError(
            f"{where}: {key!r} is stored as {stored} but the model holds {live}; a load only casts between "
            "float32 and float16/bfloat16. Build the model in the stored dtype, or convert the checkpoint explicitly")
