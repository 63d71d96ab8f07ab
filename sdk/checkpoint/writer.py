"""Atomic, multi-rank checkpoint writing."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    CheckpointError,
    SafetensorsStreamWriter,
    dtype_tag,
    fsync_dir,
    rank_entry,
    write_bytes_durable,
    write_failure,
    write_safetensors,
)
from .merge import merge_parts
from .publish import (
    FAULT_ENV,
    FAULT_STEPS,
    CheckpointBusyError,
    acquire_lock,
    fault_point,
    prune_checkpoints,
    recover_checkpoints,
    release_lock,
    rename_into_place,
    update_latest,
)
from .reader import tmp_prefix
from .schema import NAME_RE as _NAME_RE
from .state import encode_state

__all__ = [
    "FAULT_ENV",
    "FAULT_STEPS",
    "CheckpointBusyError",
    "CheckpointWriter",
    "ShardPiece",
    "prune_checkpoints",
    "recover_checkpoints",
    "update_latest",
]

_PART = ".part-rank{:05d}.json"
_SAVE_ID = ".save-id"


def _kept(path: Path) -> str:
    return f"nothing was published ({path} was not saved): the previous checkpoint and `latest` are unchanged"


def _named_write_errors(method: Callable) -> Callable:
    """A write's ``OSError`` (a full disk) becomes a :class:`CheckpointError` naming the file and what was kept."""
    @functools.wraps(method)
    def wrapper(self: CheckpointWriter, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            raise write_failure(e, _kept(self.path)) from None
    return wrapper


@dataclass(frozen=True)
class ShardPiece:
    """One rank's piece of a global tensor.

    Exactly one of ``offsets`` or ``flat_range`` is given:

    * ``offsets``: an N-d box; ``tensor`` is the box (its shape is the box shape) and ``offsets`` is
      where the box starts in the global tensor.
    * ``flat_range=(a, b)``: ``tensor`` is 1-D of length ``b - a`` holding elements ``[a, b)`` of the
      row-major flattened global tensor (the ZeRO / FSDP1 flat-parameter layout).

    Pieces of one tensor from different ranks may overlap (replicas); a reader takes any of them.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...] | None = None
    flat_range: tuple[int, int] | None = None

    def describe(self, where: str) -> dict[str, Any]:
        """Validates the piece and returns its index entry (without file/tensor names)."""
        g = tuple(int(x) for x in self.global_shape)
        shape = tuple(self.tensor.shape)
        if (self.offsets is None) == (self.flat_range is None):
            raise CheckpointError(f"{where}: give exactly one of offsets= or flat_range= to ShardPiece")
        if self.offsets is not None:
            o = tuple(int(x) for x in self.offsets)
            if len(o) != len(g) or len(shape) != len(g):
                raise CheckpointError(f"{where}: offsets {o} and tensor shape {shape} must both have "
                                      f"{len(g)} dims like global_shape {g}")
            if any(a < 0 or a + s > n for a, s, n in zip(o, shape, g)):
                raise CheckpointError(f"{where}: box at offsets {o} with shape {shape} exceeds global_shape {g}")
            return {"offsets": list(o), "shape": list(shape)}
        a, b = (int(x) for x in self.flat_range)
        if self.tensor.dim() != 1 or shape[0] != b - a or not 0 <= a <= b <= math.prod(g):
            raise CheckpointError(f"{where}: flat_range ({a}, {b}) needs a 1-D tensor of {b - a} elements "
                                  f"within 0..{math.prod(g)} (global_shape {g}); got shape {shape}")
        return {"flat_range": [a, b]}


class CheckpointWriter:
    """Writes one checkpoint directory atomically, from one or many ranks.

    Rank 0 takes an exclusive lock on ``parent/.shardkit.lock`` for the whole save (a second save into
    the same parent fails at once with :class:`CheckpointBusyError`; the lock dies with its process),
    repairs what killed saves left behind (:func:`recover_checkpoints`), and makes a fresh hidden
    directory ``parent/.<name>.tmp-<id>`` that every rank writes into. On a clean exit every rank fsyncs
    its files and writes its manifest part, rank 0 checks that every part belongs to this save, merges
    them into ``shardkit.json``, renames the directory into place, moves ``parent/latest`` and prunes
    old checkpoints. On an exception nothing becomes visible and ``latest`` is untouched. All ranks
    must see the same filesystem.

    Args:
        path: this save's directory, e.g. ``runs/ckpt/step-000100``.
        rank: this process's rank.
        world_size: number of ranks taking part; each must enter and exit the writer.
        barrier: a callable that blocks until every rank calls it (e.g. ``torch.distributed.barrier``);
            ``None`` only when ``world_size == 1``.
        broadcast: ``broadcast(obj) -> obj`` from rank 0 to every rank (``Runner.broadcast``); tells the
            other ranks which temporary directory is theirs, or that rank 0 could not start. Without it
            they find it through ``parent/.<name>.saving``, which a second job saving the same path at
            the same moment could overwrite.
        keep_last: keep only this many newest checkpoints in ``parent`` (the new one included).
        info: JSON-able dict stored in the manifest (step, strategy, ...), returned by ``reader.info``.
        update_latest: move ``parent/latest`` to this checkpoint (default True).
        scripts: ``{file name: bytes}`` of executable tools rank 0 puts beside the entries (a ZeRO checkpoint's
            ``zero_to_fp32.py``); not listed in the manifest, so never read as checkpoint content.
    """

    def __init__(self, path: str | os.PathLike, *, rank: int = 0, world_size: int = 1,
                 barrier: Callable[[], Any] | None = None, broadcast: Callable[[Any], Any] | None = None,
                 keep_last: int | None = None, info: Mapping[str, Any] | None = None,
                 update_latest: bool = True, scripts: Mapping[str, bytes] | None = None) -> None:
        self.path = Path(path)
        if not _NAME_RE.match(self.path.name):
            raise CheckpointError(f"{self.path}: checkpoint directory name must match {_NAME_RE.pattern}")
        if world_size > 1 and barrier is None:
            raise CheckpointError(f"{self.path}: world_size={world_size} needs a barrier callable")
        if not 0 <= rank < world_size:
            raise CheckpointError(f"{self.path}: rank {rank} is outside world_size {world_size}")
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"{self.path}: keep_last must be >= 1 or None, got {keep_last}")
        self.rank, self.world_size, self.keep_last = rank, world_size, keep_last
        self.info = dict(info or {})
        try:
            json.dumps(self.info)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: info must be JSON-serialisable: {e}") from None
        self.update_latest = update_latest
        self.scripts = dict(scripts or {})
        for name in self.scripts:
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.py", name):
                raise CheckpointError(f"{self.path}: script name {name!r} must be a plain file name ending in .py")
        self._barrier = barrier or (lambda: None)
        self._broadcast = broadcast
        self.tmp: Path | None = None
        self._lock: int | None = None
        self._files: dict[str, dict[str, Any]] = {}
        self._entries: dict[str, dict[str, Any]] = {}
        self._open = False

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> CheckpointWriter:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort(exc)

    def open(self) -> None:
        """Rank 0 locks, recovers and creates the temporary directory; every rank learns its name."""
        msg: Any = None
        failure: Exception | None = None
        if self.rank == 0:
            try:
                msg = self._start()
            except Exception as e:  # the other ranks must hear of it, not wait in the broadcast
                failure, msg = e, {"error": str(e), "busy": isinstance(e, CheckpointBusyError)}
        if self._broadcast is not None and self.world_size > 1:
            msg = self._broadcast(msg)
        elif self.world_size > 1:
            self._barrier()
            if self.rank != 0:
                msg = self._read_pointer()
        if failure is not None:
            raise failure
        if isinstance(msg, dict):
            cls = CheckpointBusyError if msg.get("busy") else CheckpointError
            raise cls(f"{self.path}: rank 0 could not start the save: {msg.get('error')}")
        self.tmp = self.path.parent / msg
        try:
            self._save_id = (self.tmp / _SAVE_ID).read_text()
        except OSError as e:
            raise CheckpointError(f"{self.tmp}: rank {self.rank} cannot see the temporary directory made by "
                                  f"rank 0 ({e}); all ranks must share one filesystem") from None
        self._open = True

    def _start(self) -> str:
        """Rank 0: lock the parent, repair killed saves, make this save's directory; returns its name."""
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True)
        self._lock = acquire_lock(parent, self.path)
        try:
            fault_point("locked")
            recover_checkpoints(parent)
            fault_point("recovered")
            save_id = uuid.uuid4().hex
            tmp = parent / f"{tmp_prefix(self.path.name)}{save_id[:16]}"
            tmp.mkdir()
            write_bytes_durable(tmp / _SAVE_ID, save_id.encode())
            if self._broadcast is None and self.world_size > 1:
                write_bytes_durable(self._pointer(), tmp.name.encode())
            fault_point("tmp-created")
        except BaseException:
            self._release()
            raise
        return tmp.name

    def _pointer(self) -> Path:
        return self.path.parent / f".{self.path.name}.saving"

    def _read_pointer(self) -> str:
        f = self._pointer()
        try:
            return f.read_text()
        except OSError as e:
            raise CheckpointError(f"{f}: rank {self.rank} cannot find rank 0's temporary directory ({e}); "
                                  "all ranks must share one filesystem") from None

    def _release(self) -> None:
        if self._lock is not None:
            release_lock(self.path.parent, self._lock)
            self._lock = None

    def commit(self) -> None:
        """Publishes the checkpoint (every rank must call it)."""
        self._check_open()
        failure: BaseException | None = None
        try:
            self._write_part(error=None)
        except OSError as e:  # rank 0 then finds no part from this rank and publishes nothing
            failure = write_failure(e, _kept(self.path))
        self._open = False
        self._barrier()
        if self.rank == 0:
            try:
                if failure is None:
                    self._publish()
            except OSError as e:
                failure = write_failure(e, _kept(self.path))
            except BaseException as e:  # other ranks must still reach the barrier below
                failure = e
            finally:
                if failure is not None:
                    if self.tmp is not None and (self.tmp / _SAVE_ID).is_file():  # never remove a published dir
                        shutil.rmtree(self.tmp, ignore_errors=True)
                    self._pointer().unlink(missing_ok=True)
                self._release()
        self._barrier()
        if failure is not None:
            raise failure
        if self.rank != 0:
            self._confirm()

    def abort(self, exc: BaseException | None = None) -> None:
        """Discards this save; called on an exception inside ``with``. Keeps the barrier count in step."""
        if not self._open:
            return
        self._open = False
        try:
            try:
                self._write_part(error=repr(exc)[:1000] if exc is not None else "aborted")
            except OSError:  # the disk that failed the save may fail this too: rank 0 then finds no part
                pass
            self._barrier()
            if self.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self._pointer().unlink(missing_ok=True)
            self._barrier()
        except Exception:  # NOTE: the original exception is what the caller needs to see
            pass
        finally:
            self._release()

    # ---------------------------------------------------------------- writing
    @_named_write_errors
    def write_tensors(self, name: str, tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> None:
        """Writes a flat dict of full tensors to ``<name>.safetensors``.

        Tensors are copied to CPU one at a time, non-contiguous ones are packed, and tensors that are
        the same view of the same storage (tied weights) are stored once and come back as one object.
        """
        self._new_entry(name)
        items: list[tuple[str, torch.Tensor]] = []
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for key, t in tensors.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{name}: write_tensors needs str -> Tensor, got {key!r}: {type(t).__name__}")
            if t.device.type == "meta":
                raise CheckpointError(f"{name}: {key} is on the meta device and has no data to save")
            ident = _storage_identity(t)
            if ident is not None and ident in seen:
                aliases[key] = seen[ident]
                continue
            if ident is not None:
                seen[ident] = key
            items.append((key, t))
        file = f"{name}.safetensors"
        self._record(file, write_safetensors(self.tmp / file, items, dict(metadata) if metadata else None))
        self._entries[name] = {"kind": "tensors", "file": file, "keys": list(tensors), "aliases": aliases}

    @_named_write_errors
    def write_json(self, name: str, obj: Any) -> None:
        """Writes ``obj`` as ``<name>.json``.

        Plain JSON: int dict keys become strings and tuples lists (use write_state to keep them); NaN
        and Infinity are written as Python's json does, so that a diverged loss never blocks a save.
        """
        self._new_entry(name)
        try:
            data = json.dumps(obj, indent=1).encode()
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{name}: write_json needs plain JSON ({e}); use write_state for tensors, "
                                  "tuples, int keys or numpy values") from None
        file = f"{name}.json"
        self._record(file, write_bytes_durable(self.tmp / file, data))
        self._entries[name] = {"kind": "json", "file": file}

    @_named_write_errors
    def write_state(self, name: str, nested: Any) -> None:
        """Writes nested dict/list/tuple state: tensors to ``<name>.safetensors``, the rest to ``<name>.json``.

        ``read_state`` returns the same structure: tuples, int/tuple dict keys, numpy arrays and
        scalars, torch dtypes and the same-object sharing of tensors are all kept.
        """
        self._new_entry(name)
        skeleton, tensors = encode_state(nested, name)
        tfile, jfile = f"{name}.safetensors", f"{name}.json"
        self._record(tfile, write_safetensors(self.tmp / tfile, tensors.items()))
        self._record(jfile, write_bytes_durable(self.tmp / jfile, json.dumps(skeleton).encode()))
        self._entries[name] = {"kind": "state", "file": tfile, "skeleton": jfile}

    @_named_write_errors
    def write_shard(self, name: str, pieces: Mapping[str, ShardPiece | Sequence[ShardPiece]]) -> None:
        """Writes this rank's pieces of sharded tensors to ``<name>.rank<NNNNN>.safetensors``.

        Every rank holding pieces calls it with the same ``name``; rank 0 indexes them on commit.
        """
        self._new_entry(name)
        items: list[tuple[str, torch.Tensor]] = []
        index: dict[str, dict[str, Any]] = {}
        for key, value in pieces.items():
            plist = [value] if isinstance(value, ShardPiece) else list(value)
            descs = []
            for i, p in enumerate(plist):
                where = f"{name}: {key} (rank {self.rank})"
                if not isinstance(p, ShardPiece):
                    raise CheckpointError(f"{where}: expected ShardPiece, got {type(p).__name__}")
                desc = p.describe(where)
                desc["tensor"] = key if len(plist) == 1 else f"{key}#{i}"
                items.append((desc["tensor"], p.tensor))
                descs.append(desc)
            dtypes = {p.tensor.dtype for p in plist}
            if len(dtypes) > 1:
                raise CheckpointError(f"{name}: {key}: pieces on rank {self.rank} have mixed dtypes {dtypes}")
            index[key] = {"shape": [int(x) for x in plist[0].global_shape] if plist else [],
                          "dtype": dtype_tag(plist[0].tensor.dtype, f"{name}: {key}") if plist else None,
                          "pieces": descs}
        file = f"{rank_entry(name, self.rank)}.safetensors"
        self._record(file, write_safetensors(self.tmp / file, items))
        for desc in (d for e in index.values() for d in e["pieces"]):
            desc["file"] = file
        self._entries[name] = {"kind": "sharded", "index": index}

    @_named_write_errors
    def write_shard_streamed(self, name: str, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                             fetch: Callable[[str], torch.Tensor]) -> None:
        """Like :meth:`write_shard` with one whole-tensor piece per key, fetched one at a time (``fetch(key)``
        is called in ``specs`` order and dropped once written), so a conversion holds one tensor, not the
        entry."""
        self._new_entry(name)
        file = f"{rank_entry(name, self.rank)}.safetensors"
        w = SafetensorsStreamWriter(self.tmp / file, [(k, d, tuple(s)) for k, d, s in specs])
        try:
            for key, _, _ in specs:
                w.write(key, fetch(key))
        except BaseException:
            w.abort()
            raise
        self._record(file, w.close())
        self._entries[name] = {"kind": "sharded", "index": {
            k: {"shape": [int(x) for x in s], "dtype": dtype_tag(d, f"{name}: {k}"),
                "pieces": [{"offsets": [0] * len(s), "shape": [int(x) for x in s], "tensor": k, "file": file}]}
            for k, d, s in specs}}

    # ---------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if not self._open:
            raise CheckpointError(f"{self.path}: the writer is not open; use `with CheckpointWriter(...) as w:`")

    def _new_entry(self, name: str) -> None:
        self._check_open()
        if not _NAME_RE.match(name) or name in ("shardkit", LATEST):
            raise CheckpointError(f"{self.path}: entry name {name!r} must match {_NAME_RE.pattern}")
        if name in self._entries:
            raise CheckpointError(f"{self.path}: entry {name!r} was already written by rank {self.rank}")

    def _record(self, file: str, size_sha: tuple[int, str]) -> None:
        self._files[file] = {"size": size_sha[0], "sha256": size_sha[1]}
        fault_point("file-written")

    def _write_part(self, error: str | None) -> None:
        part = {"rank": self.rank, "save_id": self._save_id, "error": error, "files": self._files,
                "entries": self._entries}
        write_bytes_durable(self.tmp / _PART.format(self.rank), json.dumps(part).encode())
        fault_point("part-written")

    def _read_parts(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's part, checked to belong to this save (a checked publish)."""
        try:
            mine = (self.tmp / _SAVE_ID).read_text()
        except OSError:
            mine = None
        if mine != self._save_id:
            raise CheckpointError(f"{self.tmp}: no longer holds this save (its id changed or it was removed by "
                                  "another process); nothing was published")
        parts = []
        for r in range(self.world_size):
            f = self.tmp / _PART.format(r)
            try:
                part = json.loads(f.read_text())
            except OSError:
                raise CheckpointError(f"{f}: rank {r} wrote no manifest part; the save of {self.path} is "
                                      "abandoned") from None
            if not isinstance(part, dict) or part.get("save_id") != self._save_id or part.get("rank") != r:
                raise CheckpointError(f"{f}: belongs to another save (rank {r} wrote into the wrong temporary "
                                      "directory?); nothing was published")
            parts.append(part)
        return parts

    def _publish(self) -> None:
        """Rank 0: merge the parts, write the manifest, rename into place, move latest, prune."""
        parts = self._read_parts()
        failed = [(p["rank"], p["error"]) for p in parts if p["error"]]
        if failed:
            raise CheckpointError(f"{self.path}: rank {failed[0][0]} failed during save ({failed[0][1]}); "
                                  "nothing was published and `latest` is unchanged")
        files, entries = merge_parts(parts, self.tmp)
        created = time.time()
        manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "world_size": self.world_size,
                    "save_id": self._save_id, "created": created,
                    "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                    "info": self.info, "entries": entries, "files": files}
        for name, data in self.scripts.items():
            if name in files:
                raise CheckpointError(f"{self.path}: script {name!r} has the name of a checkpoint file")
            write_bytes_durable(self.tmp / name, data)
            mode = (self.tmp / name).stat().st_mode
            os.chmod(self.tmp / name, mode | (mode & 0o444) >> 2)  # executable by whoever may read it
        write_bytes_durable(self.tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        fault_point("manifest-written")
        for r in range(self.world_size):
            (self.tmp / _PART.format(r)).unlink()
        (self.tmp / _SAVE_ID).unlink()
        fsync_dir(self.tmp)
        fault_point("tmp-sealed")
        rename_into_place(self.tmp, self.path)
        self._pointer().unlink(missing_ok=True)
        if self.update_latest:
            update_latest(self.path)
        if self.keep_last is not None:
            prune_checkpoints(self.path.parent, self.keep_last, keep=self.path)

    def _confirm(self) -> None:
        try:
            ok = json.loads((self.path / MANIFEST).read_text()).get("save_id") == self._save_id
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{self.path}: rank 0 did not publish this save (see rank 0's error); "
                                  "the previous checkpoint and `latest` are unchanged")


def _storage_identity(t: torch.Tensor) -> tuple | None:
    """What makes two tensors the same tied weight: same storage, offset, shape, strides and dtype."""
    if t.numel() == 0:
        return None  # NOTE: empty tensors may all report data_ptr 0
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
