"""Schema checks for the JSON a checkpoint holds: the manifest, sharded indexes and the ``latest`` pointer.

Every file of a checkpoint is hostile input. Each check here raises :class:`CheckpointError` naming the
file and the field (``entries.model.keys[3]``), never a bare ``KeyError``/``TypeError``. Every file a
checkpoint names must be a plain name inside its directory: no separators, no ``..``, no absolute path,
and no symlink that resolves outside the directory.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from .format import FORMAT_NAME, FORMAT_VERSION, CheckpointError, dtype_from_tag

__all__ = ["NAME_RE", "check_index", "check_manifest", "member_path", "read_latest", "read_small_file"]

# The names the writer produces (directories, entries and files): no separators, no leading dot.
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_KIND_FIELDS = {"tensors": ("file",), "json": ("file",), "state": ("file", "skeleton"), "sharded": ("index",)}
_CORRUPT = "the checkpoint is corrupt or was edited; restore it from a copy or save it again"


class _Field:
    """Builds errors that name the file and the dotted field path."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def fail(self, field: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: field {field!r} {problem}; {_CORRUPT}")

    def obj(self, v: Any, field: str) -> dict:
        if not isinstance(v, dict):
            raise self.fail(field, f"must be an object, got {type(v).__name__}")
        return v

    def get(self, d: dict, key: str, field: str) -> Any:
        if key not in d:
            raise self.fail(f"{field}.{key}" if field else key, "is missing")
        return d[key]

    def int_(self, v: Any, field: str, lo: int = 0) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise self.fail(field, f"must be an integer >= {lo}, got {v!r:.60}")
        return v

    def str_(self, v: Any, field: str) -> str:
        if not isinstance(v, str):
            raise self.fail(field, f"must be a string, got {type(v).__name__}")
        return v

    def ints(self, v: Any, field: str) -> list[int]:
        if not isinstance(v, list):
            raise self.fail(field, f"must be a list of integers, got {type(v).__name__}")
        return [self.int_(x, f"{field}[{i}]") for i, x in enumerate(v)]

    def name(self, v: Any, field: str) -> str:
        s = self.str_(v, field)
        if not NAME_RE.match(s):
            raise self.fail(field, f"is {s!r:.80}, not a plain file name inside the checkpoint (no '/', no "
                                   "'..', no absolute path, no leading dot)")
        return s


def member_path(directory: Path, name: str, where: str) -> Path:
    """``directory / name`` after checking that it is a plain name and not a symlink (the writer makes none;
    one that resolves outside the checkpoint would load foreign data under the manifest's hashes)."""
    if not NAME_RE.match(name):
        raise CheckpointError(f"{where}: {name!r:.80} is not a plain file name inside {directory}; {_CORRUPT}")
    p = directory / name
    if p.is_symlink():
        target = p.resolve()
        inside = "inside the checkpoint" if target.parent == directory.resolve() else "outside the checkpoint"
        raise CheckpointError(f"{where}: {p} is a symlink to {target}, {inside}; a checkpoint's files must be "
                              "regular files in its directory, refusing it")
    return p


def read_small_file(path: Path, limit: int, what: str) -> bytes:
    """Reads a regular, non-symlink file of at most ``limit`` bytes (a FIFO or /dev/zero would hang or fill
    memory)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror}); {what} must be a regular file") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise CheckpointError(f"{path}: {what} must be a regular file of at most {limit} bytes")
        return f.read(limit + 1)


def check_manifest(m: Any, file: Path) -> dict[str, Any]:
    """Validates a parsed ``shardkit.json``; returns it."""
    f = _Field(file)
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise CheckpointError(f"{file}: format is {got!r:.80}, expected {FORMAT_NAME!r}; not a shardkit checkpoint")
    if m.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {m.get('version')!r:.40} is not supported by this shardkit "
                              f"(it reads version {FORMAT_VERSION}); upgrade shardkit to read it")
    f.int_(f.get(m, "world_size", ""), "world_size", lo=1)
    f.obj(m.get("info", {}), "info")
    if "created" in m and (not isinstance(m["created"], (int, float)) or isinstance(m["created"], bool)):
        raise f.fail("created", "must be a number")
    files = f.obj(f.get(m, "files", ""), "files")
    for name, meta in files.items():
        where = f"files.{name}"
        f.name(name, where)
        meta = f.obj(meta, where)
        f.int_(f.get(meta, "size", where), f"{where}.size")
        if not _SHA_RE.match(f.str_(f.get(meta, "sha256", where), f"{where}.sha256")):
            raise f.fail(f"{where}.sha256", "must be 64 lowercase hex digits")
    for ename, e in f.obj(f.get(m, "entries", ""), "entries").items():
        _check_entry(f, ename, e, files)
    return m


def _check_entry(f: _Field, ename: Any, e: Any, files: dict) -> None:
    where = f"entries.{ename}"
    f.name(ename, where)
    e = f.obj(e, where)
    kind = f.get(e, "kind", where)
    if kind not in _KIND_FIELDS:
        raise f.fail(f"{where}.kind", f"is {kind!r:.40}, expected one of {sorted(_KIND_FIELDS)}")
    for key in _KIND_FIELDS[kind]:
        if f.name(f.get(e, key, where), f"{where}.{key}") not in files:
            raise f.fail(f"{where}.{key}", f"names {e[key]!r}, which is not listed under 'files' (so it has no "
                                           "size or sha256 to check)")
    if kind != "tensors":
        return
    keys = f.get(e, "keys", where)
    if not isinstance(keys, list):
        raise f.fail(f"{where}.keys", f"must be a list of strings, got {type(keys).__name__}")
    for i, k in enumerate(keys):
        f.str_(k, f"{where}.keys[{i}]")
    if len(set(keys)) != len(keys):
        raise f.fail(f"{where}.keys", "lists a key twice")
    aliases = f.obj(f.get(e, "aliases", where), f"{where}.aliases")
    known = set(keys)
    for k, v in aliases.items():
        if k not in known or not isinstance(v, str) or v not in known or v in aliases:
            raise f.fail(f"{where}.aliases.{k}", f"maps {k!r:.60} to {v!r:.60}; both must be keys of the entry "
                                                 "and the target must be stored (not itself an alias)")


def check_index(idx: Any, file: Path, files: dict) -> dict[str, Any]:
    """Validates a sharded entry's ``<name>.index.json``; returns its ``tensors`` object."""
    f = _Field(file)
    tensors = f.obj(f.get(f.obj(idx, "<top>"), "tensors", ""), "tensors")
    for key, e in tensors.items():
        where = f"tensors.{key}"
        e = f.obj(e, where)
        shape = f.ints(f.get(e, "shape", where), f"{where}.shape")
        dtype_from_tag(f.str_(f.get(e, "dtype", where), f"{where}.dtype"), f"{file}: field {where}.dtype")
        pieces = f.get(e, "pieces", where)
        if not isinstance(pieces, list):
            raise f.fail(f"{where}.pieces", "must be a list")
        for i, p in enumerate(pieces):
            _check_piece(f, f"{where}.pieces[{i}]", f.obj(p, f"{where}.pieces[{i}]"), shape, files)
    return tensors


def _check_piece(f: _Field, where: str, p: dict, shape: list[int], files: dict) -> None:
    if f.name(f.get(p, "file", where), f"{where}.file") not in files:
        raise f.fail(f"{where}.file", f"names {p['file']!r}, which is not listed in the manifest's 'files'")
    f.str_(f.get(p, "tensor", where), f"{where}.tensor")
    if "offsets" in p:
        off = f.ints(p["offsets"], f"{where}.offsets")
        box = f.ints(f.get(p, "shape", where), f"{where}.shape")
        if len(off) != len(shape) or len(box) != len(shape) or any(
                o + s > n for o, s, n in zip(off, box, shape)):
            raise f.fail(where, f"box at {off} of shape {box} does not fit the global shape {shape}")
        return
    rng = f.ints(f.get(p, "flat_range", where), f"{where}.flat_range")
    if len(rng) != 2 or not rng[0] <= rng[1] <= math.prod(shape):
        raise f.fail(f"{where}.flat_range", f"is {rng}, not a range within 0..{math.prod(shape)}")


def read_latest(parent: Path) -> str:
    """Reads ``parent/latest``: the name of a child directory of ``parent``, nothing else."""
    latest = parent / "latest"
    raw = read_small_file(latest, 4096, "`latest`")
    try:
        target = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{latest}: not UTF-8 text ({e.reason} at byte {e.start}); it must hold the name "
                              "of a checkpoint directory next to it; fix or delete the file") from None
    if not NAME_RE.match(target):
        raise CheckpointError(f"{latest}: holds {target!r:.80}, but `latest` may only name a checkpoint directory "
                              f"next to it (no '/', '..', absolute path or leading dot); fix or delete the file")
    cand = parent / target
    if cand.is_symlink() and cand.resolve().parent != parent.resolve():
        raise CheckpointError(f"{latest}: names {target!r}, a symlink to {cand.resolve()} outside {parent}; "
                              "refusing to follow it")
    return target
