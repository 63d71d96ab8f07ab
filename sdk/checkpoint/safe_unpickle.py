"""Reading ``torch.save`` zip files without executing them: an allowlist unpickler with mmap-backed tensors.

DeepSpeed's checkpoints are pickles. ``torch.load(weights_only=True)`` rejects them (they hold a
loss-scaler object, a ``ZeroStageEnum`` and fragment-address dataclasses) and ``weights_only=False``
runs whatever the file says. :func:`load_torch_zip` accepts only tensors and storages, plain
containers, a few torch value types, and a short list of DeepSpeed's plain classes, each replaced by
an inert stand-in that merely records its fields. Any other global is refused with
:class:`UnsafePickleError` naming it, before anything is called.

Tensors come back as views of a private, read-only-in-practice ``mmap`` of the file: nothing is read
until a tensor's bytes are touched, and :meth:`TorchZipFile.release` drops the touched pages again, so
reading a 100 GB optimizer file to pull out one tensor costs about that tensor's size.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import io
import mmap
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError

__all__ = ["DeepSpeedStandIn", "TorchZipFile", "UnsafePickleError", "ZeroStage", "load_torch_zip"]


class UnsafePickleError(CheckpointError):
    """A pickle asked for a global (a class or function) outside the allowlist; nothing was run."""


class DeepSpeedStandIn:
    """An inert stand-in for one of DeepSpeed's plain classes: keeps the pickled fields, runs nothing."""

    ds_class = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        else:
            self.state = state

    def __repr__(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "args" or v}
        return f"<{self.ds_class} {fields}>"


def _stand_in(qualified: str) -> type[DeepSpeedStandIn]:
    return type(qualified.rsplit(".", 1)[1], (DeepSpeedStandIn,), {"ds_class": qualified})


class ZeroStage(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _StorageType:
    """What ``torch.FloatStorage`` & co. unpickle to: just the element dtype of the storage."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "UntypedStorage": torch.uint8,
}
_DTYPE_NAMES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                "float", "double", "half", "long", "int"]
# The DeepSpeed classes its ZeRO and bf16 optimizers put in checkpoints (loss scaler, stage enum,
# per-parameter fragment addresses); their fields are plain numbers, so a record of them is enough.
_DEEPSPEED_CLASSES = [
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScalerBase",
    "deepspeed.utils.tensor_fragment.fragment_address",
]


def _rebuild_tensor_v2(storage: torch.Tensor, offset: int, size: Any, stride: Any, *_: Any) -> torch.Tensor:
    if not isinstance(storage, torch.Tensor):
        raise UnsafePickleError(f"a tensor was rebuilt from {type(storage).__name__}, not from a storage")
    try:
        return storage.as_strided(tuple(int(s) for s in size), tuple(int(s) for s in stride), int(offset))
    except (RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"a tensor's shape {size} / stride {stride} / offset {offset} does not fit its "
                              f"storage of {storage.numel()} elements: {e}") from None


def _rebuild_parameter(data: torch.Tensor, *_: Any) -> torch.Tensor:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # The tensor subclass and its __dict__ (DeepSpeed's ds_* attributes) are dropped: a plain tensor is the data.
    if func not in (_rebuild_tensor_v2, _rebuild_parameter):
        raise UnsafePickleError(f"_rebuild_from_type_v2 with {func!r}")
    return func(*args)


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    if encoding != "latin1":
        raise UnsafePickleError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _allowlist() -> dict[str, Any]:
    allowed: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.slice": slice,
        "_codecs.encode": _latin1,
        "torch.Size": torch.Size, "torch.device": torch.device,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.Tensor": torch.Tensor, "torch.nn.parameter.Parameter": torch.Tensor,
        "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    }
    allowed.update({f"torch.{n}": _StorageType(d) for n, d in _STORAGE_DTYPES.items()})
    allowed.update({f"torch.{n}": getattr(torch, n) for n in _DTYPE_NAMES})
    allowed.update({q: _stand_in(q) for q in _DEEPSPEED_CLASSES})
    return allowed


_ALLOWED = _allowlist()
_PY2_MODULES = {"__builtin__": "builtins"}  # torch.save writes protocol 2, which spells builtins the old way
_SETSTATE_OK = (DeepSpeedStandIn,)


class _RestrictedUnpickler(pickle._Unpickler):  # the pure-Python one, so BUILD can be restricted too
    def __init__(self, data: bytes, where: str, storage: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._storage = storage
        self.dispatch = dict(pickle._Unpickler.dispatch)
        self.dispatch[pickle.BUILD[0]] = _RestrictedUnpickler._load_build

    def find_class(self, module: str, name: str) -> Any:
        key = f"{_PY2_MODULES.get(module, module)}.{name}"
        if key in _ALLOWED:
            return _ALLOWED[key]
        raise UnsafePickleError(
            f"{self._where}: refuses to load global {key!r}: only tensors, containers and DeepSpeed's plain "
            "checkpoint classes are accepted, so nothing in the file is executed. If you trust the file, load it "
            "with torch.load(weights_only=False) yourself")

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise UnsafePickleError(f"{self._where}: unexpected persistent id {str(pid)[:80]}")
        return self._storage(str(pid[2]), pid[1].dtype, int(pid[4]))

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, _SETSTATE_OK):
            inst.__setstate__(state)
        elif isinstance(inst, collections.OrderedDict) and isinstance(state, dict):
            pass  # a state_dict's `_metadata` (module versions): not needed, not kept
        elif state not in (None, {}):
            raise UnsafePickleError(f"{self._where}: refuses to set state on a {type(inst).__name__}")


class TorchZipFile:
    """One ``torch.save`` zip file: its records located, its storages mapped lazily.

    Args:
        path: the ``.pt`` file.

    Raises:
        CheckpointError: the file is missing, truncated, not a torch zip file, or compressed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            with zipfile.ZipFile(self.path) as z:
                infos = z.infolist()
                pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
                if len(pkl) != 1:
                    raise CheckpointError(f"{self.path}: a zip file but not a torch.save file (no data.pkl)")
                self._prefix = pkl[0].filename[: -len("data.pkl")]
                self._pickle = z.read(pkl[0])
                bo = self._prefix + "byteorder"
                if bo in z.namelist() and z.read(bo).strip() not in (b"little", b""):
                    raise CheckpointError(f"{self.path}: saved on a big-endian host; re-save it on a little-endian one")
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no such file") from None
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise CheckpointError(f"{self.path}: not a complete torch.save zip file ({e}); the file is truncated or "
                                  "was written by torch < 1.6 (legacy format); re-save it or copy it again") from None
        self._size = self.path.stat().st_size
        self._records = {i.filename: i for i in infos}
        self._fd = os.open(self.path, os.O_RDONLY)
        # ACCESS_COPY: a private mapping, so frombuffer gets a writable buffer without a copy; the file never changes
        self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY) if self._size else None
        self._base = 0
        if self._mm is not None:
            view = ctypes.c_char.from_buffer(self._mm)
            self._base = ctypes.addressof(view)
            del view  # the export would keep the mapping from closing

    def file_offset(self, t: torch.Tensor) -> int | None:
        """Where ``t``'s first element lies in the file, when ``t`` is a view of this file's mapping."""
        ptr = t.data_ptr()
        if self._mm is None or not self._base <= ptr < self._base + self._size:
            return None
        return ptr - self._base

    def read_into(self, out: torch.Tensor, offset: int) -> None:
        """Fills the contiguous CPU tensor ``out`` with its byte count read at ``offset`` (pread: no page-cache
        pages mapped into this process, so reading does not grow RSS)."""
        buf = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path}: unexpected end of file at byte {offset + done} (truncated?)")
            done += n

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.path}: record {info.filename} is compressed; torch.save never does that")
        header = self._mm[info.header_offset: info.header_offset + 30]
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{self.path}: broken zip local header for {info.filename}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > self._size:
            raise CheckpointError(f"{self.path}: record {info.filename} runs past the end of the file (truncated)")
        return start

    def storage(self, key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat tensor over record ``data/<key>``, mapped, not read."""
        info = self._records.get(f"{self._prefix}data/{key}")
        if info is None:
            raise CheckpointError(f"{self.path}: the pickle names storage {key!r}, which the file lacks (truncated?)")
        item = torch.empty((), dtype=dtype).element_size()
        if numel * item > info.file_size:
            raise CheckpointError(f"{self.path}: storage {key} holds {info.file_size} bytes, not {numel} x {item}")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=self._data_offset(info))

    def load(self) -> Any:
        """Unpickles the file's object with the allowlist; tensors are views of the mapping."""
        try:
            return _RestrictedUnpickler(self._pickle, str(self.path), self.storage).load()
        except CheckpointError:
            raise
        except Exception as e:  # a malformed pickle: name the file, not pickle's internals
            raise CheckpointError(f"{self.path}: cannot read the pickle ({type(e).__name__}: {e})") from None

    def release(self) -> None:
        """Drops the pages read so far from this process (they are re-read from the file if touched again)."""
        if self._mm is not None:
            self._mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Unmaps the file when no tensor still points into it (else the mapping lives on with them)."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
        os.close(self._fd)


def load_torch_zip(path: str | os.PathLike) -> Any:
    """Loads a ``torch.save`` file through the allowlist; tensors are lazily mapped from the file.

    Raises:
        UnsafePickleError: naming the first global outside the allowlist (nothing is executed).
        CheckpointError: the file is missing, truncated or malformed.
    """
    return TorchZipFile(path).load()
