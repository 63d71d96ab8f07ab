"""Schema checks for the JSON a checkpoint holds: the manifest, sharded indexes and the ``latest`` pointer.

Every file of a checkpoint is hostile input. Each check here raises :class:`CheckpointError` naming the
file and the field (``entries.model.keys[3]``), never a bare ``KeyError``/``TypeError``. Every file a
checkpoint names must be a plain name inside its directory: no separators, no ``..``, no absolute path,
and no symlink that resolves outside the directory.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from .format import FORMAT_NAME, FORMAT_VERSION, CheckpointError, dtype_from_tag
from .trust import NAME_RE, check_child_dir, describe, member_path, read_small_file

__all__ = ["NAME_RE", "Fields", "check_index", "check_manifest", "member_path", "read_latest", "read_small_file"]

_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_KIND_FIELDS = {"tensors": ("file",), "json": ("file",), "state": ("file", "skeleton"), "sharded": ("index",)}
_CORRUPT = "the checkpoint is corrupt or was edited; restore it from a copy or save it again"


class Fields:
    """Checks values of one file and builds errors that name the file and the dotted field path.

    Args:
        file: the file the values come from.
        advice: what the error tells the user to do.
    """

    def __init__(self, file: Path, advice: str = _CORRUPT) -> None:
        self.file = file
        self.advice = advice

    def fail(self, field: str, problem: str) -> CheckpointError:
        """The error for ``field`` (``entries.model.keys[3]``) having ``problem``."""
        return CheckpointError(f"{self.file}: field {describe(field, 200)} {problem}; {self.advice}")

    def obj(self, v: Any, field: str) -> dict:
        if not isinstance(v, dict):
            raise self.fail(field, f"must be an object, got {type(v).__name__}")
        return v

    def get(self, d: dict, key: str, field: str) -> Any:
        if key not in d:
            raise self.fail(f"{field}.{key}" if field else key, "is missing")
        return d[key]

    def int_(self, v: Any, field: str, lo: int = 0, hi: int | None = None) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise self.fail(field, f"must be an integer {bound}, got {describe(v)}")
        return v

    def number(self, v: Any, field: str, lo: float, hi: float) -> float:
        """A finite int or float in ``[lo, hi]``."""
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and lo <= v <= hi):
            raise self.fail(field, f"must be a finite number in [{lo:g}, {hi:g}], got {describe(v)}")
        return v

    def bool_(self, v: Any, field: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(field, f"must be true or false, got {describe(v)}")
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
            raise self.fail(field, f"is {describe(s, 80)}, not a plain file name in this directory (no '/', no "
                                   "'..', no absolute path, no leading dot)")
        return s


def check_manifest(m: Any, file: Path) -> dict[str, Any]:
    """Validates a parsed ``shardkit.json``; returns it."""
    f = Fields(file)
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise CheckpointError(f"{file}: format is {describe(got, 80)}, expected {FORMAT_NAME!r}; not a shardkit "
                              "checkpoint")
    if m.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format version {describe(m.get('version'), 40)} is not supported by this "
                              f"shardkit (it reads version {FORMAT_VERSION}); upgrade shardkit to read it")
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


def _check_entry(f: Fields, ename: Any, e: Any, files: dict) -> None:
    where = f"entries.{ename}"
    f.name(ename, where)
    e = f.obj(e, where)
    kind = f.get(e, "kind", where)
    if kind not in _KIND_FIELDS:
        raise f.fail(f"{where}.kind", f"is {describe(kind, 40)}, expected one of {sorted(_KIND_FIELDS)}")
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
            raise f.fail(f"{where}.aliases.{k}", f"maps {describe(k)} to {describe(v)}; both must be keys of the entry "
                                                 "and the target must be stored (not itself an alias)")


def check_index(idx: Any, file: Path, files: dict) -> dict[str, Any]:
    """Validates a sharded entry's ``<name>.index.json``; returns its ``tensors`` object."""
    f = Fields(file)
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


def _check_piece(f: Fields, where: str, p: dict, shape: list[int], files: dict) -> None:
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
    check_child_dir(parent, target, str(latest))
    return target


_MAX_STEPS = 1 << 53  # past this a float step counter stops counting; no run gets near it


def check_runner_state(state: Any, file: Path) -> dict[str, Any]:
    """Validates ``runner.json`` (the accumulation position ``Runner.save`` writes); returns it."""
    f = Fields(file)
    f.obj(state, "(the whole file)")
    gas = state.get("gradient_accumulation_steps")
    if gas is not None:
        f.int_(gas, "gradient_accumulation_steps", lo=1, hi=1 << 31)
    f.int_(f.get(state, "micro_step", ""), "micro_step", hi=(gas or 1 << 31) - 1)
    f.bool_(f.get(state, "boundary", ""), "boundary")
    f.int_(f.get(state, "optimizer_steps", ""), "optimizer_steps", hi=_MAX_STEPS)
    return state


_SCALER_FIELDS = ("scale", "hysteresis_left", "good_steps", "skipped_steps")


def check_precision_state(state: Any, file: Path) -> dict[str, Any]:
    """Validates ``precision.json`` (the loss scaler's state under fp16, else empty); returns it.

    The scaler sets each field as an attribute, so only its own four fields are accepted.
    """
    f = Fields(file)
    f.obj(state, "(the whole file)")
    if "loss_scaler" not in state:
        return state
    scaler = f.obj(state["loss_scaler"], "loss_scaler")
    unknown = [k for k in scaler if k not in _SCALER_FIELDS]
    if unknown:
        raise f.fail(f"loss_scaler.{unknown[0]}", f"is not a loss-scaler field (expected {list(_SCALER_FIELDS)})")
    f.number(f.get(scaler, "scale", "loss_scaler"), "loss_scaler.scale", 2.0 ** -126, 2.0 ** 127)
    for key in _SCALER_FIELDS[1:]:
        f.int_(f.get(scaler, key, "loss_scaler"), f"loss_scaler.{key}", hi=_MAX_STEPS)
    return state


def check_hf_index(idx: Any, file: Path) -> dict[str, str]:
    """Validates a Hugging Face ``model.safetensors.index.json``; returns its ``weight_map``.

    Every shard it names must be a plain file name of the index's directory.
    """
    f = Fields(file, advice="fix the index or export the model again")
    top = f.obj(idx, "(the whole file)")
    f.obj(top.get("metadata", {}), "metadata")
    weight_map = f.obj(f.get(top, "weight_map", ""), "weight_map")
    for key, shard in weight_map.items():
        f.name(shard, f"weight_map.{key}")
    return weight_map
