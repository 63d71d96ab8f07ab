"""Writing a torch.distributed.checkpoint (DCP) directory tensor by tensor, as torch's FileSystemWriter lays it out.

One data file ``__0_0.distcp`` holds each tensor as a ``torch.save`` record at its byte range and each
non-tensor value as a ``torch.save`` of the value; ``.metadata`` pickles torch's own ``Metadata`` (written
here, by torch's classes: writing trusts nothing that was read). Each key's path in the nested state dict is
recorded as ``dcp.save`` records it, so ``dcp.load`` fills a state dict of either layout
(:class:`~shardkit.checkpoint.dcp_reader.DCPLayout`). Only one tensor is held at a time.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from .dcp_metadata import DCP_METADATA
from .format import CheckpointError, naming

__all__ = ["DATA_FILE", "DCPStreamWriter"]

DATA_FILE = "__0_0.distcp"


class DCPStreamWriter:
    """Appends tensors and values to one DCP data file; :meth:`close` writes ``.metadata`` (and fsyncs both).

    Args:
        directory: an existing, empty directory (a conversion's staging directory).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        from torch.distributed.checkpoint import metadata  # deferred: start-up time (torch.distributed)

        self._md = metadata
        self.directory = Path(directory)
        self._path = self.directory / DATA_FILE
        with naming(self._path):
            self._f = open(self._path, "wb")
        self._sdm: dict[str, Any] = {}
        self._storage: dict[Any, Any] = {}
        self._planner: dict[str, tuple] = {}

    def _key(self, path: tuple[str | int, ...]) -> str:
        key = ".".join(str(p) for p in path)
        if key in self._sdm:
            raise CheckpointError(f"{self._path}: key {key!r} written twice")
        self._planner[key] = tuple(path)
        return key

    def _append(self, obj: Any) -> tuple[int, int]:
        offset = self._f.tell()
        buf = io.BytesIO()
        torch.save(obj, buf)
        with naming(self._path):
            self._f.write(buf.getbuffer())
        return offset, self._f.tell() - offset

    def tensor(self, path: tuple[str | int, ...], t: torch.Tensor) -> None:
        """Writes ``t`` (whole, one chunk) under the nested path ``path``."""
        md = self._md
        key = self._key(path)
        t = t.detach().to("cpu").contiguous()
        offset, length = self._append(t)
        zeros = torch.Size([0] * t.dim())
        self._sdm[key] = md.TensorStorageMetadata(properties=md.TensorProperties(dtype=t.dtype), size=t.size(),
                                                  chunks=[md.ChunkStorageMetadata(offsets=zeros, sizes=t.size())])
        self._storage[md.MetadataIndex(key, zeros)] = _storage_info(offset, length)

    def value(self, path: tuple[str | int, ...], value: Any) -> None:
        """Writes a plain Python value (a float, a tuple, a list of names) under ``path``, as ``dcp.save`` does."""
        md = self._md
        key = self._key(path)
        offset, length = self._append(value)
        self._sdm[key] = md.BytesStorageMetadata()
        self._storage[md.MetadataIndex(key)] = _storage_info(offset, length)

    def close(self) -> list[str]:
        """Fsyncs the data file and writes ``.metadata``; returns the two file names."""
        with naming(self._path):
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        md = self._md
        meta = md.Metadata(state_dict_metadata=self._sdm, planner_data=self._planner, storage_data=self._storage,
                           storage_meta=md.StorageMeta(), version="1.0.0")
        target = self.directory / DCP_METADATA
        with naming(target), open(target, "wb") as f:
            pickle.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        return [DATA_FILE, DCP_METADATA]

    def abort(self) -> None:
        """Closes the data file without publishing anything (the caller discards the directory)."""
        if not self._f.closed:
            try:
                self._f.close()
            except OSError:
                pass


def _storage_info(offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # deferred: start-up time (torch.distributed)

    return _StorageInfo(relative_path=DATA_FILE, offset=offset, length=length)
