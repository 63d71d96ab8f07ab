"""The index of a torch.distributed.checkpoint (DCP) directory, read as hostile input.

DCP's ``.metadata`` is a pickle of torch's dataclasses (``Metadata``, ``TensorStorageMetadata``, ...) keyed by
flattened names, saying for every tensor its global shape and dtype and, per chunk (one rank's shard), which
``*.distcp`` file holds it at which byte range. It is read through the restricted unpickler with only those
plain classes allowed, each replaced by an inert stand-in, then checked field by field into :class:`DCPIndex`:

* every file it names is a plain child of the directory (no ``/``, ``..``, symlink);
* every byte range lies inside a file that exists, and holds at least the bytes its chunk claims (a shape of
  10**12 elements needs 4 TB that are not there);
* every chunk lies inside its tensor, and the chunks' element counts add up to the tensor's;
* dtypes are ones the safetensors format holds; storage transforms (DCP's compression extensions) are refused
  by name rather than read as raw bytes.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError, dtype_tag
from .safe_unpickle import PickleStandIn, UnsafePickleError, allowlist, restricted_loads
from .trust import describe, member_path, read_small_file

__all__ = ["DCP_METADATA", "DCPBytes", "DCPChunk", "DCPIndex", "DCPTensor", "is_dcp_checkpoint", "read_dcp_index"]

DCP_METADATA = ".metadata"
_MAX_METADATA = 512 << 20  # DCP's index of a 400B model with optimizer state is a few hundred MB at most
_MAX_KEYS = 1 << 24
_MAX_DIMS = 64
_DCP = "torch.distributed.checkpoint"
_STAND_INS = [f"{_DCP}.metadata.{n}" for n in ("Metadata", "TensorStorageMetadata", "TensorProperties",
                                                 "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                                 "StorageMeta")] + [f"{_DCP}.filesystem._StorageInfo"]


def _stand_in(qualified: str) -> type[PickleStandIn]:
    return type(qualified.rsplit(".", 1)[1], (PickleStandIn,), {"qualified": qualified})


def _mem_format(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= 3:
        raise UnsafePickleError(f"_MEM_FORMAT_ENCODING({describe(value)}): not a memory format")
    return value


def _layout(name: Any) -> str:
    if name != "torch.strided":
        raise UnsafePickleError(f"tensor layout {describe(name)}: only dense (torch.strided) tensors are read")
    return name


def _path(*parts: Any) -> str:
    if not all(type(p) is str and len(p) < 4096 for p in parts):
        raise UnsafePickleError(f"a path of {describe(parts)}")
    return os.path.join(*parts) if parts else ""


_CLASSES = {q: _stand_in(q) for q in _STAND_INS}
_ALLOWED = allowlist({**_CLASSES, f"{_DCP}.metadata._MEM_FORMAT_ENCODING": _mem_format,
                      "torch.serialization._get_layout": _layout, "pathlib.PosixPath": _path,
                      "pathlib.WindowsPath": _path, "pathlib.Path": _path})


@dataclass(frozen=True)
class DCPChunk:
    """One stored piece of a tensor: the box ``[offsets, offsets + sizes)`` at ``file[offset:offset + length]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DCPTensor:
    """A tensor of the checkpoint: its flattened key, global shape, dtype and chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[DCPChunk, ...]


@dataclass(frozen=True)
class DCPBytes:
    """A non-tensor value (a pickled Python value or raw ``BytesIO`` bytes) at ``file[offset:offset + length]``."""

    key: str
    file: str
    offset: int
    length: int


@dataclass
class DCPIndex:
    """What ``.metadata`` says, checked: tensors and byte items by flattened key, and each key's path in the
    nested state dict that was saved (``("optimizer", "state", "w", "exp_avg")``)."""

    directory: Path
    tensors: dict[str, DCPTensor] = field(default_factory=dict)
    items: dict[str, DCPBytes] = field(default_factory=dict)
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # file name -> size in bytes


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding DCP's ``.metadata`` file."""
    return (Path(path) / DCP_METADATA).is_file()


def _field(obj: Any, name: str, where: str) -> Any:
    if name not in obj.__dict__:
        raise CheckpointError(f"{where}: has no field {name!r}; the metadata is corrupt or of an unknown version")
    return obj.__dict__[name]


def _is(obj: Any, short: str) -> bool:
    return type(obj) is _CLASSES.get(f"{_DCP}.metadata.{short}", _CLASSES.get(f"{_DCP}.filesystem.{short}"))


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS or not all(
            type(x) is int and 0 <= x < 1 << 62 for x in value):
        raise CheckpointError(f"{where}: {describe(value)} is not a list of up to {_MAX_DIMS} non-negative integers")
    return tuple(value)


def read_dcp_index(directory: str | os.PathLike) -> DCPIndex:
    """Reads and checks ``directory/.metadata`` (see the module docstring).

    Raises:
        UnsafePickleError: the pickle names a global outside DCP's metadata classes (nothing is executed).
        CheckpointError: naming ``.metadata`` and the field at fault.
    """
    directory = Path(directory)
    meta_file = directory / DCP_METADATA
    where = str(meta_file)
    md = restricted_loads(read_small_file(meta_file, _MAX_METADATA, "DCP metadata"), where, _ALLOWED)
    if not _is(md, "Metadata"):
        raise CheckpointError(f"{where}: holds {describe(md)}, not DCP's Metadata")
    index = DCPIndex(directory)
    sdm = _field(md, "state_dict_metadata", where)
    storage = _field(md, "storage_data", where)
    if type(sdm) is not dict or type(storage) is not dict or len(sdm) > _MAX_KEYS or len(storage) > _MAX_KEYS:
        raise CheckpointError(f"{where}: state_dict_metadata / storage_data are not dicts of at most {_MAX_KEYS}")
    places = _storage_places(index, storage, where)
    for key, meta in sdm.items():
        if type(key) is not str:
            raise CheckpointError(f"{where}: a key is {describe(key)}, not a string")
        here = f"{where}: {describe(key, 120)}"
        if _is(meta, "BytesStorageMetadata"):
            file, offset, length = _place(places, key, None, here)
            index.items[key] = DCPBytes(key, file, offset, length)
        elif _is(meta, "TensorStorageMetadata"):
            index.tensors[key] = _tensor(key, meta, places, here)
        else:
            raise CheckpointError(f"{here}: is described by {describe(meta)}, not a tensor or bytes entry")
    planner = md.__dict__.get("planner_data")
    for key in sdm:
        path = planner.get(key) if isinstance(planner, dict) else None
        if not (type(path) is tuple and path and all(type(p) is str or (type(p) is int and 0 <= p < 1 << 31)
                                                     for p in path)):
            path = (key,)  # no flattening record: the key is the path
        index.paths[key] = path
    return index


def _storage_places(index: DCPIndex, storage: dict, where: str) -> dict[tuple[str, tuple | None], tuple]:
    places = {}
    for mi, info in storage.items():
        if not _is(mi, "MetadataIndex") or not _is(info, "_StorageInfo"):
            raise CheckpointError(f"{where}: storage_data maps {describe(mi)} to {describe(info)}")
        fqn, off = _field(mi, "fqn", where), mi.__dict__.get("offset")
        if type(fqn) is not str:
            raise CheckpointError(f"{where}: storage_data names {describe(fqn)}, not a key")
        here = f"{where}: storage of {describe(fqn, 120)}"
        file = _field(info, "relative_path", here)
        f = member_path(index.directory, file, here)
        if file not in index.files:
            try:
                st = f.lstat()
            except OSError:
                raise CheckpointError(f"{here}: names {f}, which does not exist") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{here}: names {f}, which is not a regular file")
            index.files[file] = st.st_size
        offset, length = _field(info, "offset", here), _field(info, "length", here)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or \
                offset + length > index.files[file]:
            raise CheckpointError(f"{here}: bytes [{describe(offset)}, +{describe(length)}) are not inside {f} "
                                  f"({index.files[file]} bytes): the file is truncated or the metadata forged")
        if info.__dict__.get("transform_descriptors"):
            raise CheckpointError(f"{here}: is stored through transforms {describe(info.transform_descriptors)} "
                                  "(a DCP storage extension such as compression), which shardkit does not read; "
                                  "save the checkpoint without extensions")
        places[(fqn, None if off is None else _ints(off, here))] = (file, offset, length)
    return places


def _place(places: dict, key: str, offsets: tuple | None, here: str) -> tuple[str, int, int]:
    found = places.get((key, offsets))
    if found is None:
        what = "its bytes" if offsets is None else f"its chunk at {list(offsets)}"
        raise CheckpointError(f"{here}: storage_data does not say where {what} are stored")
    return found


def _tensor(key: str, meta: Any, places: dict, here: str) -> DCPTensor:
    props = _field(meta, "properties", here)
    state = props.__dict__.get("state") if isinstance(props, PickleStandIn) else None
    dtype = state[0] if type(state) is tuple and state else getattr(props, "__dict__", {}).get("dtype")
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{here}: its dtype is {describe(dtype)}, not a torch dtype")
    dtype_tag(dtype, here)
    shape = _ints(_field(meta, "size", here), f"{here}: size")
    chunks_meta = _field(meta, "chunks", here)
    if type(chunks_meta) is not list or len(chunks_meta) > _MAX_KEYS:
        raise CheckpointError(f"{here}: chunks is {describe(chunks_meta)}, not a list")
    item = torch.empty((), dtype=dtype).element_size()
    chunks, total = [], 0
    for c in chunks_meta:
        if not _is(c, "ChunkStorageMetadata"):
            raise CheckpointError(f"{here}: a chunk is {describe(c)}")
        offsets = _ints(_field(c, "offsets", here), f"{here}: chunk offsets")
        sizes = _ints(_field(c, "sizes", here), f"{here}: chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > g for o, s, g in zip(offsets, sizes, shape)):
            raise CheckpointError(f"{here}: chunk at {list(offsets)} of shape {list(sizes)} is outside the tensor's "
                                  f"shape {list(shape)}")
        file, offset, length = _place(places, key, offsets, here)
        numel = math.prod(sizes)
        if numel * item > length:
            raise CheckpointError(f"{here}: chunk at {list(offsets)} claims {numel} x {item} bytes but is stored in "
                                  f"{length} bytes of {file}: the metadata is forged or the file truncated")
        total += numel
        chunks.append(DCPChunk(offsets, sizes, file, offset, length))
    if total != math.prod(shape):
        raise CheckpointError(f"{here}: its chunks hold {total} elements, its shape {list(shape)} needs "
                              f"{math.prod(shape)}: a rank's chunks are missing from the metadata")
    return DCPTensor(key, shape, dtype, tuple(chunks))
