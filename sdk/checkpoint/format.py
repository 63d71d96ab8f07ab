"""On-disk format pieces shared by the writer, the reader and the consolidation tool.

A shardkit checkpoint is a directory holding safetensors files, JSON files and one manifest,
``shardkit.json``. Nothing is pickled: reading a checkpoint never executes code.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST",
    "LATEST",
    "PRECISION_ENTRY",
    "RUNNER_ENTRY",
    "USER_KINDS_ENTRY",
    "USER_VALUES_ENTRY",
    "SafetensorsStreamWriter",
    "describe_foreign",
    "dtype_from_tag",
    "dtype_tag",
    "flat_to_boxes",
    "naming",
    "rank_entry",
    "fsync_dir",
    "fsync_path",
    "sha256_file",
    "write_bytes_durable",
    "write_failure",
]

FORMAT_NAME = "shardkit-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "shardkit.json"
LATEST = "latest"
# The entries Runner.save writes beside the user's objects: each saved name's kind ("module", "optimizer", ...),
# the plain values, the step position and the precision's loss scale. A converter that writes a checkpoint a
# Runner resumes writes them too.
USER_KINDS_ENTRY = "entries"
USER_VALUES_ENTRY = "values"
RUNNER_ENTRY = "runner"
PRECISION_ENTRY = "precision"

# safetensors dtype tags (the spec's names) for every torch dtype it can hold.
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES_BACK = {v: k for k, v in _DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and what is wrong."""


def dtype_tag(dtype: torch.dtype, where: str = "") -> str:
    """Returns the safetensors tag of ``dtype`` (``"BF16"``), or raises naming ``where``.

    Not :func:`shardkit.utils.dtypes.dtype_name` (``"bf16"``, the config spelling): this is the file format's tag.
    """
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CheckpointError(
            f"{where}: dtype {dtype} cannot be stored in safetensors; supported: "
            f"{', '.join(str(d) for d in _DTYPES)}. Convert it first (e.g. complex -> torch.view_as_real)."
        ) from None


def dtype_from_tag(tag: str, where: str = "") -> torch.dtype:
    """Inverse of :func:`dtype_tag`."""
    try:
        return _DTYPES_BACK[tag]
    except KeyError:
        raise CheckpointError(f"{where}: unknown safetensors dtype {tag!r}") from None


def rank_entry(key: str, rank: int) -> str:
    """The entry name of one rank's own copy of ``key``: ``rank_entry("rng", 3) == "rng.rank00003"``.

    Five digits keep a directory listing in rank order up to 99,999 ranks; every writer and reader of
    per-rank entries (data loader positions, RNG states, sharded tensor files) goes through here.
    """
    return f"{key}.rank{rank:05d}"


def fsync_path(path: Path) -> None:
    """fsyncs a file or directory by its path (a file written by another open, or through a library)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsyncs a directory so that entries created or renamed in it survive a power loss."""
    fsync_path(path)


# errnos that mean "no room": a full disk, a quota, a file-size limit (RLIMIT_FSIZE, `ulimit -f`)
_NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Re-raises an ``OSError`` that names no file (a write's ENOSPC or EFBIG) with ``path`` as its filename."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def write_failure(e: OSError, consequence: str) -> CheckpointError:
    """The error for a failed write: the file, the reason, and ``consequence`` (what was kept)."""
    hint = "; the disk is full or a file-size limit (ulimit -f) was hit" if e.errno in _NO_ROOM else ""
    return CheckpointError(f"{e.filename}: cannot be written ({e.strerror or e}){hint}; {consequence}")


def write_bytes_durable(path: Path, data: bytes) -> tuple[int, str]:
    """Writes ``data`` to ``path``, fsyncs it, and returns (size, sha256 hex)."""
    with naming(path), open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data), hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hashes a file in 1 MiB chunks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _cpu_bytes(t: torch.Tensor) -> memoryview:
    """A CPU, contiguous, byte view of ``t`` without a second host copy when it is already on CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


class SafetensorsStreamWriter:
    """Writes a safetensors file tensor by tensor, hashing as it goes.

    The header (names, dtypes, shapes) is fixed up front, so only one tensor is ever held beyond the
    caller's own: peak memory stays near the largest tensor. The file is fsynced on :meth:`close`.

    Args:
        path: the file to create.
        specs: ``(name, dtype, shape)`` in the order the tensors will be written.
        metadata: optional ``__metadata__`` (str -> str), as safetensors requires.
    """

    def __init__(self, path: Path, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":
            raise CheckpointError("safetensors is little-endian; big-endian hosts are not supported")
        self.path = Path(path)
        header: dict[str, Any] = {}
        if metadata:
            bad = {k: type(v).__name__ for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
            if bad:
                raise CheckpointError(f"{self.path.name}: safetensors metadata must map str to str; got {bad}")
            header["__metadata__"] = dict(metadata)
        self._expected: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        offset = 0
        for name, dtype, shape in specs:
            if name in header:
                raise CheckpointError(f"{self.path.name}: tensor name {name!r} appears twice")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": dtype_tag(dtype, f"{self.path.name}:{name}"), "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes with spaces
        self._hash = hashlib.sha256()
        self._size = 0
        self._next = 0
        with naming(self.path):
            self._f = open(self.path, "wb")
        self._put(len(raw).to_bytes(8, "little") + raw)

    def _put(self, data: bytes | memoryview) -> None:
        with naming(self.path):
            self._f.write(data)
        self._hash.update(data)
        self._size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Writes the next tensor; ``name``, dtype and shape must match the next spec."""
        if self._next >= len(self._expected):
            raise CheckpointError(f"{self.path.name}: more tensors written than declared (extra {name!r})")
        want_name, dtype, shape, _ = self._expected[self._next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{self.path.name}: expected {want_name!r} {dtype} {list(shape)}, got {name!r} {tensor.dtype} "
                f"{list(tensor.shape)} (a tensor changed while it was being saved?)")
        self._put(_cpu_bytes(tensor))
        self._next += 1

    def close(self) -> tuple[int, str]:
        """Flushes and fsyncs; returns (size in bytes, sha256 hex)."""
        if self._next != len(self._expected):
            missing = self._expected[self._next][0]
            self.abort()
            raise CheckpointError(f"{self.path.name}: closed before tensor {missing!r} was written")
        with naming(self.path):
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        return self._size, self._hash.hexdigest()

    def abort(self) -> None:
        """Closes the file without fsync (the caller discards it)."""
        if not self._f.closed:
            try:
                self._f.close()
            except OSError:  # the buffered tail hits the same full disk; the file is discarded anyway
                pass


def write_safetensors(path: Path, items: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Writes ``(name, tensor)`` pairs to one safetensors file; returns (size, sha256)."""
    items = list(items)
    w = SafetensorsStreamWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in items], metadata)
    try:
        for n, t in items:
            w.write(n, t)
    except BaseException:
        w.abort()
        raise
    return w.close()


def flat_to_boxes(start: int, end: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Splits the row-major flat range ``[start, end)`` of a tensor of ``shape`` into boxes.

    Returns ``(offsets, box_shape, flat_start)`` triples; each box's elements are contiguous in the
    flat order, starting at ``flat_start``. At most ``2 * ndim - 1`` boxes come back.
    """
    shape = tuple(shape)
    if start >= end or math.prod(shape) == 0:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    rest = shape[1:]

    def in_row(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((row, *o), (1, *s), row * inner + f) for o, s, f in flat_to_boxes(a, b, rest)]

    r0, r1 = start // inner, end // inner
    if r0 == r1:
        return in_row(r0, start - r0 * inner, end - r0 * inner)
    boxes = []
    if start % inner:
        boxes += in_row(r0, start % inner, inner)
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest), r0 * inner))
    if end % inner:
        boxes += in_row(r1, 0, end % inner)
    return boxes


_FOREIGN_HINT = "shardkit cannot load it directly; it only reads directories written by shardkit.checkpoint"


def describe_foreign(path: Path) -> str:
    """A sentence saying what a non-shardkit directory looks like (DeepSpeed, torch.save, HF), or ''."""
    if not path.is_dir():
        return ""
    names = sorted(p.name for p in path.iterdir())
    # a ds_to_universal output (or the folder naming one) holds DeepSpeed's file names too, but zero-to-fp32 does
    # not read it; shardkit convert carries its optimizer and step as well
    if "latest_universal" in names or (path / "zero" / "optimizer_state.pt").is_file():
        return (f"it looks like a DeepSpeed universal checkpoint; {_FOREIGN_HINT}: convert it with "
                f"`shardkit convert {path} OUT_DIR --to shardkit` (model, optimizer and step; no DeepSpeed needed) "
                "and load OUT_DIR")
    ds = [n for n in names if n.startswith(("mp_rank_", "zero_pp_rank_", "bf16_zero_pp_rank_")) or
          n.startswith("global_step")]
    if ds:
        return (f"it looks like a DeepSpeed checkpoint ({', '.join(ds[:3])}); {_FOREIGN_HINT}: convert it with "
                f"`shardkit zero-to-fp32 {path} OUT_DIR` (no DeepSpeed needed) and load the result with "
                "shardkit.checkpoint.hf.load_pretrained, or get_fp32_state_dict(); to resume with the optimizer, "
                "run DeepSpeed's ds_to_universal on it and `shardkit convert` its output --to shardkit")
    pt = [n for n in names if n.endswith((".pt", ".pth", ".bin", ".ckpt", ".pkl"))]
    if pt:
        return (f"it looks like a torch.save/pickle checkpoint ({', '.join(pt[:3])}); {_FOREIGN_HINT}: load it "
                "with torch.load(weights_only=True) yourself if you trust it, then save with shardkit")
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        return "it looks like a Hugging Face model directory; load it with from_pretrained"
    return ""
