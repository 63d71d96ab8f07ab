"""Reading shardkit checkpoints: validation, full tensors, nested state and sharded tensors."""

from __future__ import annotations

import glob
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .assemble import read_region
from .format import (
    LATEST,
    MANIFEST,
    CheckpointError,
    describe_foreign,
    dtype_from_tag,
    sha256_file,
)
from .safefile import SafetensorsFile, read_checked_bytes
from .schema import check_index, check_manifest, member_path, read_latest, read_small_file
from .state import decode_state

__all__ = ["CheckpointReader", "hidden_copies", "old_name", "resolve_checkpoint", "tmp_prefix"]

_MAX_MANIFEST = 256 << 20  # ~1M files' worth of entries; a bigger "manifest" is not one


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """Returns the checkpoint directory for ``path``: itself, or the target of ``path/latest``.

    ``latest`` may only name a child directory. When its target is missing because a save over the
    same name was killed, the save's complete hidden copy (the new one, else the old one) is returned.

    Raises:
        CheckpointError: naming the path when there is no checkpoint there (and saying what the
            directory looks like when it is a DeepSpeed or torch.save directory).
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = path / LATEST
    if latest.is_file():
        target = read_latest(path)
        cand = path / target
        if (cand / MANIFEST).is_file():
            return cand
        hidden = hidden_copies(path, target)
        if hidden:
            return hidden[0]
        if cand.is_dir():
            _raise_not_ours(cand)
        hint = describe_foreign(path)
        raise CheckpointError(f"{latest}: points to {target!r}, but {cand} does not exist or is not a shardkit "
                              f"checkpoint{'; ' + hint if hint else ''}")
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    _raise_not_ours(path)
    raise AssertionError("unreachable")


def tmp_prefix(name: str) -> str:
    """Hidden directories of saves of ``name`` in progress (or killed) start with this."""
    return f".{name}.tmp-"


def old_name(name: str) -> str:
    """Where a save over an existing ``name`` parks the old copy between its two renames."""
    return f".{name}.old"


def hidden_copies(parent: Path, name: str) -> list[Path]:
    """Complete hidden copies of checkpoint ``name`` left by a killed save: published-but-not-renamed
    saves (newest first), then the old copy. A copy counts only when its manifest passes the schema
    and every file it lists has the recorded size."""
    tmps = []
    for d in parent.glob(f"{glob.escape(tmp_prefix(name))}*"):
        created = _complete_created(d)
        if created is not None:
            tmps.append((created, d.name, d))
    out = [d for _, _, d in sorted(tmps, reverse=True)]
    old = parent / old_name(name)
    if _complete_created(old) is not None:
        out.append(old)
    return out


def _complete_created(d: Path) -> float | None:
    if not (d / MANIFEST).is_file() or d.is_symlink():
        return None
    try:
        r = CheckpointReader(d, verify=False)
    except CheckpointError:
        return None
    r.close()
    return float(r.manifest.get("created", 0.0))


def _raise_not_ours(path: Path) -> None:
    hint = describe_foreign(path)
    raise CheckpointError(f"{path / MANIFEST}: missing, so {path} is not a shardkit checkpoint (and it has no "
                          f"`{LATEST}` file){'; ' + hint if hint else ''}")


class CheckpointReader:
    """Opens a checkpoint directory, validates it, and reads its entries.

    Every file the manifest names must lie inside the directory and have the recorded size. With
    ``verify`` (the default) each file is also hashed the first time it is read, from the same memory
    map its tensors are then copied out of, and must match the manifest's sha256 before any of its
    bytes are used: one pass over the data. Files never read are never hashed; :meth:`verify_all`
    checks every file at once.

    Args:
        path: a checkpoint directory, or a parent directory holding ``latest``.
        verify: check each file's sha256 as it is read. ``False`` only checks sizes (faster on huge
            checkpoints you trust; a flipped bit then loads as a wrong weight).

    Raises:
        CheckpointError: naming the file and what is wrong (missing manifest, bad JSON, a field of the
            wrong type, a path leaving the directory, unknown format version, missing or truncated
            file, sha256 mismatch).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True) -> None:
        self.path = resolve_checkpoint(path)
        self.verify = verify
        self.manifest = self._load_manifest()
        self.info: dict[str, Any] = self.manifest.get("info", {})
        self.world_size: int = self.manifest["world_size"]
        self._entries: dict[str, dict[str, Any]] = self.manifest["entries"]
        self._files: dict[str, dict[str, Any]] = self.manifest["files"]
        self._handles: dict[str, SafetensorsFile] = {}
        self._indexes: dict[str, dict[str, Any]] = {}
        self._check_files()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drops the open files (their memory maps)."""
        self._handles.clear()

    # ---------------------------------------------------------------- validation
    def _load_manifest(self) -> dict[str, Any]:
        f = self.path / MANIFEST
        raw = read_small_file(f, _MAX_MANIFEST, "the manifest")
        try:
            m = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{f}: not valid JSON ({e}); the manifest is corrupt") from None
        return check_manifest(m, f)

    def _check_files(self) -> None:
        for name, meta in self._files.items():
            f = member_path(self.path, name, str(self.path / MANIFEST))
            try:
                st = f.lstat()
            except OSError:
                raise CheckpointError(f"{f}: listed in {MANIFEST} but missing") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{f}: listed in {MANIFEST} but not a regular file")
            size = st.st_size
            if size != meta["size"]:
                raise CheckpointError(f"{f}: is {size} bytes but {MANIFEST} says {meta['size']}: the file is "
                                      f"{'truncated' if size < meta['size'] else 'overwritten'}")

    def verify_all(self) -> None:
        """Hashes every file the manifest lists (one pass each); raises on the first mismatch."""
        for name, meta in self._files.items():
            if sha256_file(member_path(self.path, name, str(self.path / MANIFEST))) != meta["sha256"]:
                raise CheckpointError(f"{self.path / name}: sha256 does not match {MANIFEST}: the file is corrupt")

    def _entry(self, name: str, *kinds: str) -> dict[str, Any]:
        e = self._entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: has no entry {name!r}; it has {sorted(self._entries)}")
        if kinds and e["kind"] not in kinds:
            raise CheckpointError(f"{self.path}: entry {name!r} is {e['kind']!r}, not {' or '.join(kinds)}")
        return e

    def _open(self, file: str) -> SafetensorsFile:
        h = self._handles.get(file)
        if h is None:
            meta = self._files[file]
            path = member_path(self.path, file, str(self.path / MANIFEST))
            h = SafetensorsFile(path, meta["size"], meta["sha256"] if self.verify else None)
            self._handles[file] = h
        return h

    def _get(self, file: str, key: str, slices: tuple | None = None) -> torch.Tensor:
        h = self._open(file)
        if slices is None:
            return h.get_tensor(key)
        return h.get_slice(key)[slices]

    def _read_json_file(self, file: str) -> Any:
        f = member_path(self.path, file, str(self.path / MANIFEST))
        meta = self._files[file]
        try:
            data = read_checked_bytes(f, meta["size"], meta["sha256"] if self.verify else None)
        except OSError as e:
            raise CheckpointError(f"{f}: cannot be read ({e})") from None
        try:
            return json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting 1000 deep
            raise CheckpointError(f"{f}: not valid JSON ({str(e)[:200]})") from None

    # ---------------------------------------------------------------- public reads
    def has(self, name: str) -> bool:
        """Whether the checkpoint has an entry called ``name``."""
        return name in self._entries

    def entries(self) -> dict[str, str]:
        """Entry names mapped to their kind (tensors, json, state, sharded)."""
        return {k: v["kind"] for k, v in self._entries.items()}

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Reads a ``write_tensors`` entry; tied keys come back as the same tensor object."""
        e = self._entry(name, "tensors")
        out: dict[str, torch.Tensor] = {}
        stored = {k: self._get(e["file"], k) for k in e["keys"] if k not in e["aliases"]}
        for k in e["keys"]:
            out[k] = stored[e["aliases"].get(k, k)]
        return out

    def aliases(self, name: str) -> dict[str, str]:
        """Tied keys of a ``write_tensors`` entry mapped to the key whose data they share."""
        return dict(self._entry(name).get("aliases", {}))

    def read_metadata(self, name: str) -> dict[str, str]:
        """The ``metadata`` given to ``write_tensors``."""
        return self._open(self._entry(name, "tensors")["file"]).metadata() or {}

    def read_json(self, name: str, check: Callable[[Any, Path], Any] | None = None) -> Any:
        """Reads a ``write_json`` entry; ``check(value, file)`` validates it (e.g. :func:`check_runner_state`)
        and its result is returned."""
        file = self._entry(name, "json")["file"]
        value = self._read_json_file(file)
        return value if check is None else check(value, self.path / file)

    def read_state(self, name: str) -> Any:
        """Reads a ``write_state`` entry back into the structure that was written."""
        e = self._entry(name, "state")
        skeleton = self._read_json_file(e["skeleton"])
        h = self._open(e["file"])
        tensors = {k: self._get(e["file"], k) for k in h.keys()}
        return decode_state(skeleton, tensors, f"{self.path / e['skeleton']}")

    def _index(self, name: str) -> dict[str, Any]:
        if name not in self._indexes:
            e = self._entry(name, "sharded")
            idx = self._read_json_file(e["index"])
            self._indexes[name] = check_index(idx, self.path / e["index"], self._files)
        return self._indexes[name]

    def sharded_keys(self, name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Keys of an entry mapped to (global shape, dtype); works for sharded and full entries."""
        e = self._entry(name, "tensors", "sharded")
        if e["kind"] == "sharded":
            where = str(self.path / e["index"])
            return {k: (tuple(v["shape"]), dtype_from_tag(v["dtype"], where)) for k, v in self._index(name).items()}
        h = self._open(e["file"])
        out = {}
        for k in e["keys"]:
            s = h.get_slice(e["aliases"].get(k, k))
            out[k] = (tuple(s.get_shape()), dtype_from_tag(s.get_dtype(), str(self.path / e["file"])))
        return out

    def _sharded_entry(self, name: str, key: str) -> dict[str, Any]:
        idx = self._index(name)
        if key not in idx:
            raise CheckpointError(f"{self.path}: sharded entry {name!r} has no tensor {key!r}")
        return idx[key]

    def read_box(self, name: str, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Reads the box ``[offsets, offsets + shape)`` of a tensor, from whichever pieces cover it."""
        e = self._entry(name, "tensors", "sharded")
        if e["kind"] == "tensors":
            sl = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
            return self._get(e["file"], e["aliases"].get(key, key), sl if sl else None)
        return read_region(self._get, self._sharded_entry(name, key), f"{name}: {key}",
                           box=(tuple(offsets), tuple(shape)))

    def read_flat_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Reads elements ``[start, end)`` of the row-major flattened tensor as a 1-D tensor."""
        e = self._entry(name, "tensors", "sharded")
        if e["kind"] == "tensors":
            return self._get(e["file"], e["aliases"].get(key, key)).reshape(-1)[start:end].clone()
        return read_region(self._get, self._sharded_entry(name, key), f"{name}: {key}", flat=(start, end))

    def read_full(self, name: str, key: str) -> torch.Tensor:
        """Reads one whole tensor, assembling it from its pieces when the entry is sharded."""
        e = self._entry(name, "tensors", "sharded")
        if e["kind"] == "tensors":
            if key not in e["keys"]:
                raise CheckpointError(f"{self.path / e['file']}: has no tensor {key!r}")
            return self._get(e["file"], e["aliases"].get(key, key))
        ent = self._sharded_entry(name, key)
        return read_region(self._get, ent, f"{name}: {key}", box=((0,) * len(ent["shape"]), tuple(ent["shape"])))

    def iter_full_tensors(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields ``(key, full tensor)`` one at a time (tied keys are read again), so peak memory stays
        near the largest tensor."""
        e = self._entry(name, "tensors", "sharded")
        keys = e["keys"] if e["kind"] == "tensors" else list(self._index(name))
        for k in keys:
            yield k, self.read_full(name, k)
