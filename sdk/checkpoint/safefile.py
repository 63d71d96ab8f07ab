"""Reading a checkpoint file once: checked against the manifest's size and sha256 in the same pass.

A file is opened, memory-mapped and hashed from that one mapping; tensors are then copied out of the
same mapping, so the bytes that were hashed are the bytes that are used (no second open by name that a
swapped file could slip into) and the disk is read once (the hash pass pulls the pages into the page
cache; the mapping keeps memory reclaimable, so a 1 GB shard does not pin 1 GB of anonymous memory).
The safetensors header is parsed here and every field of it is checked before use.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .format import CheckpointError, dtype_from_tag, dtype_tag
from .trust import describe, open_regular

__all__ = ["SafetensorsFile", "read_checked_bytes"]

_HASH_CHUNK = 8 << 20  # 8 MiB: large enough that Python's per-call overhead vanishes next to sha256
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_checked_bytes(path: Path, size: int, sha256: str | None) -> bytes:
    """The whole file, after its size (and with ``sha256``, its hash) matched the manifest."""
    fd = open_regular(path, "a file the manifest lists", size)
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path}: sha256 does not match the manifest: the file is corrupt")
    return data


class SafetensorsFile:
    """A safetensors file opened from one memory map; a stand-in for ``safetensors.safe_open``.

    Args:
        path: the file.
        size: the size the manifest records; ``None`` takes the file's own (a Hugging Face shard).
        sha256: the hash the manifest records; ``None`` skips the hash (sizes are still checked).
        what: how errors call the file.
    """

    def __init__(self, path: Path, size: int | None, sha256: str | None,
                 what: str = "a file the manifest lists") -> None:
        self.path = path
        fd = open_regular(path, what, size)
        try:
            size = os.fstat(fd).st_size
            # NOTE: read-only, not ACCESS_COPY: a private writable map of a 100 GB shard counts in full
            # against the commit limit under vm.overcommit_memory=2.
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)
        if sha256 is not None:
            self._verify(sha256)
        self._meta, self._specs, self._base = self._parse_header(size)

    def _verify(self, sha256: str) -> None:
        h = hashlib.sha256()
        if self._mm is not None:
            # NOTE: WILLNEED (read-ahead), not SEQUENTIAL: the latter lets the kernel drop pages behind the
            # hash, and the tensor copies that follow then fault them in again (1.6 s instead of 0.4 s per GiB).
            self._mm.madvise(mmap.MADV_WILLNEED)
            view = memoryview(self._mm)
            for i in range(0, len(view), _HASH_CHUNK):
                h.update(view[i:i + _HASH_CHUNK])
            view.release()
        if h.hexdigest() != sha256:
            raise CheckpointError(f"{self.path}: sha256 does not match the manifest: the file is corrupt "
                                  "(restore it from a copy; load with verify=False only to inspect it)")

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable safetensors file ({why})")

    def _parse_header(self, size: int) -> tuple[dict[str, str], dict[str, tuple], int]:
        mm = self._mm
        if mm is None or size < 8:
            raise self._bad("shorter than the 8-byte header length")
        n = int.from_bytes(mm[:8], "little")
        if n > min(_MAX_HEADER, size - 8):
            raise self._bad(f"header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(mm[8:8 + n].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise self._bad(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._bad("__metadata__ must map strings to strings")
        base, data_len = 8 + n, size - 8 - n
        specs = {key: self._spec(key, e, data_len) for key, e in header.items()}
        return meta, specs, base

    def _spec(self, key: str, e: Any, data_len: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if not isinstance(e, dict):
            raise self._bad(f"tensor {describe(key)} has no header object")
        tag, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if not isinstance(tag, str):
            raise self._bad(f"tensor {describe(key)} has no dtype")
        dtype = dtype_from_tag(tag, f"{self.path}: {key}")
        ok = (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in shape)
              and isinstance(offs, list) and len(offs) == 2
              and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
              and 0 <= offs[0] <= offs[1] <= data_len)
        if not ok:
            raise self._bad(f"tensor {describe(key)}: shape {describe(shape)} / data_offsets {describe(offs)} are not "
                            f"valid for {data_len} data bytes")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offs[1] - offs[0] != nbytes:
            raise self._bad(f"tensor {describe(key)}: {tag} {shape} needs {nbytes} bytes, data_offsets span "
                            f"{offs[1] - offs[0]}")
        return dtype, tuple(shape), offs[0], offs[1]

    # ---------------------------------------------------------------- safe_open's interface
    def keys(self) -> list[str]:
        return list(self._specs)

    def metadata(self) -> dict[str, str]:
        return dict(self._meta)

    def _lookup(self, key: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        try:
            return self._specs[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: has no tensor {key!r}") from None

    def _bytes(self, a: int, b: int) -> torch.Tensor:
        """A fresh (aligned) copy of data bytes ``[a, b)``."""
        if b == a:
            return torch.empty(0, dtype=torch.uint8)
        # numpy reads the read-only map without torch's non-writable-buffer warning; .copy() is the one copy
        return torch.from_numpy(np.frombuffer(self._mm, dtype=np.uint8, count=b - a, offset=self._base + a).copy())

    def get_tensor(self, key: str) -> torch.Tensor:
        dtype, shape, a, b = self._lookup(key)
        return self._bytes(a, b).view(dtype).reshape(shape)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key)


class _Slice:
    """Lazy ``get_slice(key)[slices]``: reads only the rows of the first dimension the slices need."""

    def __init__(self, file: SafetensorsFile, key: str) -> None:
        self.file, self.key = file, key
        self.dtype, self.shape, self.start, self.end = file._lookup(key)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return dtype_tag(self.dtype)

    def __getitem__(self, slices: Any) -> torch.Tensor:
        slices = slices if isinstance(slices, tuple) else (slices,)
        if not self.shape:
            return self.file.get_tensor(self.key)
        if len(slices) > len(self.shape) or not all(isinstance(s, slice) and s.step in (None, 1) for s in slices):
            raise CheckpointError(f"{self.file.path}: {self.key}: only unit-step slices are supported, got {slices}")
        r0, r1, _ = slices[0].indices(self.shape[0])
        r1 = max(r0, r1)
        row = math.prod(self.shape[1:]) * torch.empty((), dtype=self.dtype).element_size()
        rows = self.file._bytes(self.start + r0 * row, self.start + r1 * row)
        return rows.view(self.dtype).reshape(r1 - r0, *self.shape[1:])[(slice(None), *slices[1:])].contiguous()
