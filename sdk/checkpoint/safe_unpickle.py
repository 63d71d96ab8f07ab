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
import math
import mmap
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError
from .trust import describe, open_regular

__all__ = ["DeepSpeedStandIn", "PickleStandIn", "TorchZipFile", "UnsafePickleError", "ZeroStage", "load_torch_zip",
           "allowlist", "load_torch_zip_bytes", "restricted_loads"]


class UnsafePickleError(CheckpointError):
    """A pickle asked for a global (a class or function) outside the allowlist; nothing was run."""


class PickleStandIn:
    """An inert stand-in for a foreign plain class: keeps the pickled fields, runs nothing. Hashed by identity (it
    defines no ``__eq__``/``__hash__``), so it may key a dict in a pickle at constant cost."""

    qualified = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified} with fields {sorted(k for k in self.__dict__ if k != 'args')}>"


class DeepSpeedStandIn(PickleStandIn):
    """An inert stand-in for one of DeepSpeed's plain classes: keeps the pickled fields, runs nothing."""

    ds_class = ""


def _stand_in(qualified: str) -> type[DeepSpeedStandIn]:
    return type(qualified.rsplit(".", 1)[1], (DeepSpeedStandIn,), {"ds_class": qualified, "qualified": qualified})


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


_MAX_DIMS = 64
# A ZeRO pickle holds names, shapes and numbers, never tensor bytes (those are records of their own): a few MB
# for a 70B model. Pure-Python unpickling runs ~1M opcodes a second, so this also bounds the time a crafted one takes.
_MAX_PICKLE = 128 << 20
# torch.save stores its records; a deflated one (a re-zipped file) may inflate this many times its compressed
# size, past a small floor (real pickles compress a few times; a bomb of zeros about a thousand times)
_MAX_INFLATION = 64
_SMALL_RECORD = 64 << 10
_MAX_INDEX = 1 << 62  # a size, stride or offset past this is not a tensor of any file
_STORAGE_KEY = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def _dims(v: Any, what: str) -> tuple[int, ...]:
    """A size or stride from the pickle: a short list/tuple of non-negative ints, checked before any use."""
    if not isinstance(v, (tuple, list)) or len(v) > _MAX_DIMS or not all(
            type(x) is int and 0 <= x < _MAX_INDEX for x in v):
        raise UnsafePickleError(f"a tensor's {what} is {describe(v)}, not up to {_MAX_DIMS} non-negative integers")
    return tuple(v)


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> torch.Tensor:
    """A view of ``storage``; refused when it reaches past the storage or has more elements than it (a stride-0
    ``expand`` of 4 bytes can claim 10**12 elements, which every later copy would then materialise)."""
    if not isinstance(storage, torch.Tensor):
        raise UnsafePickleError(f"a tensor was rebuilt from {type(storage).__name__}, not from a storage")
    size, stride = _dims(size, "size"), _dims(stride, "stride")
    if type(offset) is not int or not 0 <= offset < _MAX_INDEX or len(size) != len(stride):
        raise UnsafePickleError(f"a tensor's offset {describe(offset)} / size {describe(size)} / stride "
                                f"{describe(stride)} are not a view")
    have, numel = storage.numel(), math.prod(size)
    reach = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if numel else offset
    if reach > have or numel > have:
        raise CheckpointError(f"a tensor of shape {list(size)} (stride {list(stride)}, offset {offset}) needs "
                              f"{max(reach, numel)} elements, but its storage holds {have}: views larger than their "
                              "storage are refused")
    return storage.as_strided(size, stride, offset)


def _rebuild_parameter(data: Any, *_: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise UnsafePickleError(f"a parameter was rebuilt from {type(data).__name__}, not from a tensor")
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # The tensor subclass and its __dict__ (DeepSpeed's ds_* attributes) are dropped: a plain tensor is the data.
    if (func is not _rebuild_tensor_v2 and func is not _rebuild_parameter) or type(args) is not tuple:
        raise UnsafePickleError(f"_rebuild_from_type_v2 with {describe(func)} and {describe(args)}")
    return func(*args)


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    if type(text) is not str or encoding != "latin1":
        raise UnsafePickleError(f"_codecs.encode of {describe(text)} with encoding {describe(encoding)}")
    return text.encode("latin1")


def _size(dims: Any = ()) -> torch.Size:
    return torch.Size(_dims(dims, "torch.Size"))


def _device(kind: Any, index: Any = None) -> torch.device:
    if type(kind) is not str or len(kind) > 32 or not (index is None or type(index) is int and 0 <= index < 1 << 16):
        raise UnsafePickleError(f"torch.device({describe(kind)}, {describe(index)})")
    return torch.device(kind) if index is None else torch.device(kind, index)


def _zero_stage(value: Any) -> ZeroStage:
    if type(value) is not int or not 0 <= value <= 3:
        raise UnsafePickleError(f"ZeroStageEnum({describe(value)}): not a ZeRO stage")
    return ZeroStage(value)


def check_key(key: Any) -> None:
    """A dict key or set element from a pickle: a string, bytes, a float, None or an int of at most 60 bits.

    Hashing is where crafted keys cost: a tuple nesting itself by reference n levels deep hashes in 2**n steps,
    and ints that are multiples of 2**61 - 1 all hash alike (a dict of them fills in quadratic time). Strings
    and bytes hash with a per-process random key.
    """
    t = type(key)
    if t in (str, bytes, float, bool) or key is None or (t is int and -(1 << 60) < key < 1 << 60):
        return
    if isinstance(key, PickleStandIn):  # hashed by identity
        return
    raise UnsafePickleError(f"a dict key or set element is {describe(key)}; only strings, numbers and None are "
                            "accepted (hashing a crafted key can take hours)")


def _checked(items: Any, what: str) -> list:
    if not isinstance(items, (list, tuple)):
        raise UnsafePickleError(f"{what} of {describe(items)}")
    return list(items)


def _ordered_dict(items: Any = ()) -> collections.OrderedDict:
    pairs = _checked(items, "OrderedDict")
    for pair in pairs:
        if type(pair) not in (tuple, list) or len(pair) != 2:
            raise UnsafePickleError(f"OrderedDict item {describe(pair)} is not a (key, value) pair")
        check_key(pair[0])
    return collections.OrderedDict(pairs)


def _set(items: Any = ()) -> set:
    elements = _checked(items, "set")
    for e in elements:
        check_key(e)
    return set(elements)


def _frozenset(items: Any = ()) -> frozenset:
    return frozenset(_set(items))


class _TypeMarker:
    """What ``torch.Tensor`` and ``Parameter`` unpickle to: a name, never called (``torch.Tensor(2**33)`` would
    allocate 32 GiB). They only appear as the ``new_type`` argument of ``_rebuild_from_type_v2``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _allowlist() -> dict[str, Any]:
    allowed: dict[str, Any] = {
        "collections.OrderedDict": _ordered_dict,
        "builtins.set": _set, "builtins.frozenset": _frozenset, "builtins.slice": slice,
        "_codecs.encode": _latin1,
        "torch.Size": _size, "torch.device": _device,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.Tensor": _TypeMarker("torch.Tensor"), "torch.nn.parameter.Parameter": _TypeMarker("Parameter"),
        "deepspeed.runtime.zero.config.ZeroStageEnum": _zero_stage,
    }
    allowed.update({f"torch.{n}": _StorageType(d) for n, d in _STORAGE_DTYPES.items()})
    allowed.update({f"torch.{n}": getattr(torch, n) for n in _DTYPE_NAMES})
    allowed.update({q: _stand_in(q) for q in _DEEPSPEED_CLASSES})
    return allowed


_ALLOWED = _allowlist()


def allowlist(extra: dict[str, Any]) -> dict[str, Any]:
    """The torch values every reader accepts (sizes, dtypes, devices, containers) plus ``extra``, for
    :func:`restricted_loads`."""
    return {**_ALLOWED, **extra}
_PY2_MODULES = {"__builtin__": "builtins"}  # torch.save writes protocol 2, which spells builtins the old way
_SETSTATE_OK = (PickleStandIn,)


class _RestrictedUnpickler(pickle._Unpickler):  # the pure-Python one, so BUILD and the dict ops can be checked
    def __init__(self, data: bytes, where: str, storage: Any, allowed: dict[str, Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._storage = storage
        self._allowed = _ALLOWED if allowed is None else allowed
        self.dispatch = dict(pickle._Unpickler.dispatch)
        ops = {pickle.BUILD: _RestrictedUnpickler._load_build, pickle.SETITEM: _RestrictedUnpickler._load_setitem,
               pickle.SETITEMS: _RestrictedUnpickler._load_setitems, pickle.DICT: _RestrictedUnpickler._load_dict,
               pickle.ADDITEMS: _RestrictedUnpickler._load_additems,
               pickle.FROZENSET: _RestrictedUnpickler._load_frozenset}
        self.dispatch.update({op[0]: fn for op, fn in ops.items()})

    def find_class(self, module: str, name: str) -> Any:
        key = f"{_PY2_MODULES.get(module, module)}.{name}"
        if key in self._allowed:
            return self._allowed[key]
        raise UnsafePickleError(
            f"{self._where}: refuses to load global {describe(key, 120)}: only tensors, containers and the "
            "checkpoint format's plain classes are accepted, so nothing in the file is executed. If you trust the "
            "file, load it with torch.load(weights_only=False) yourself")

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if self._storage is None:
            raise UnsafePickleError(f"{self._where}: a plain pickle names a tensor storage; none is expected here")
        ok = (type(pid) is tuple and len(pid) == 5 and type(pid[0]) is str and pid[0] == "storage"
              and isinstance(pid[1], _StorageType) and type(pid[2]) is str and _STORAGE_KEY.match(pid[2])
              and type(pid[4]) is int and 0 <= pid[4] < _MAX_INDEX)
        if not ok:
            raise UnsafePickleError(f"{self._where}: unexpected persistent id ({describe(pid)}); torch.save writes "
                                    "('storage', type, key, location, numel)")
        return self._storage(pid[2], pid[1].dtype, pid[4])

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, _SETSTATE_OK):
            inst.__setstate__(state)
        elif isinstance(inst, collections.OrderedDict) and isinstance(state, dict):
            pass  # a state_dict's `_metadata` (module versions): not needed, not kept
        elif not (state is None or type(state) is dict and not state):
            raise UnsafePickleError(f"{self._where}: refuses to set state on a {type(inst).__name__}")

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        check_key(key)
        self.stack[-1][key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        for i in range(0, len(items), 2):
            check_key(items[i])
        target = self.stack[-1]
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _load_dict(self) -> None:
        items = self.pop_mark()
        for i in range(0, len(items), 2):
            check_key(items[i])
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _load_additems(self) -> None:
        items = self.pop_mark()
        for item in items:
            check_key(item)
        target = self.stack[-1]
        if not isinstance(target, set):
            raise UnsafePickleError(f"{self._where}: ADDITEMS on a {type(target).__name__}")
        target.update(items)

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        for item in items:
            check_key(item)
        self.append(frozenset(items))


class TorchZipFile:
    """One ``torch.save`` zip file: its records located, its storages mapped lazily.

    Args:
        path: the ``.pt`` file.

    Raises:
        CheckpointError: the file is missing, truncated, not a torch zip file, or compressed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = open_regular(self.path, "the torch.save file")
        try:
            self._size = os.fstat(self._fd).st_size
            self._read_directory()
            # ACCESS_COPY: a private mapping, so frombuffer gets a writable buffer without a copy; the file never
            # changes
            self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY) if self._size else None
        except BaseException:
            os.close(self._fd)
            raise
        self._base = 0
        if self._mm is not None:
            view = ctypes.c_char.from_buffer(self._mm)
            self._base = ctypes.addressof(view)
            del view  # the export would keep the mapping from closing

    def _read_directory(self) -> None:
        """Locates the records and reads the pickle (at most :data:`_MAX_PICKLE` bytes, inflated or not)
        through the descriptor already checked to be a regular file."""
        try:
            with os.fdopen(os.dup(self._fd), "rb") as f, zipfile.ZipFile(f) as z:
                infos = z.infolist()
                for info in infos:
                    self._check_declared_size(info)
                pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
                if len(pkl) != 1:
                    raise CheckpointError(f"{self.path}: a zip file but not a torch.save file (no data.pkl)")
                self._prefix = pkl[0].filename[: -len("data.pkl")]
                self._pickle = self._read_capped(z, pkl[0], _MAX_PICKLE)
                bo = z.NameToInfo.get(self._prefix + "byteorder")
                if bo is not None and self._read_capped(z, bo, 16).strip() not in (b"little", b""):
                    raise CheckpointError(f"{self.path}: saved on a big-endian host; re-save it on a little-endian one")
        except CheckpointError:
            raise
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
                RuntimeError) as e:  # RuntimeError: zipfile's "File is encrypted"
            raise CheckpointError(f"{self.path}: not a complete torch.save zip file ({str(e)[:200]}); the file is "
                                  "truncated or was written by torch < 1.6 (legacy format); re-save it or copy it "
                                  "again") from None
        self._records = {i.filename: i for i in infos}

    def _check_declared_size(self, info: zipfile.ZipInfo) -> None:
        """From the zip directory, before any record is read: a stored record lies inside the file, and a
        compressed one inflates at most :data:`_MAX_INFLATION` times its compressed size (a 1 MB DEFLATE record
        declaring 1 GiB is a compression bomb)."""
        name = describe(info.filename, 80)
        if info.compress_type == zipfile.ZIP_STORED:
            if info.file_size > self._size:
                raise CheckpointError(f"{self.path}: record {name} declares {info.file_size} bytes, more than the "
                                      f"whole file ({self._size}); the file is damaged or forged: re-save it")
        elif info.file_size > max(_SMALL_RECORD, _MAX_INFLATION * info.compress_size):
            raise CheckpointError(f"{self.path}: record {name} declares {info.file_size} bytes inflated from "
                                  f"{info.compress_size}, more than {_MAX_INFLATION} times: a compression bomb, "
                                  "refused unread; torch.save stores its records uncompressed: re-save the file "
                                  "with torch.save")

    def _read_capped(self, z: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytes:
        """One record, refused when it declares or inflates to more than ``cap`` bytes (a 1 MB DEFLATE record
        can inflate to 1 GiB): the stream is read with a cap, never inflated whole first."""
        if info.file_size > cap or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CheckpointError(f"{self.path}: record {describe(info.filename, 80)} is {info.file_size} bytes "
                                  f"(compression {info.compress_type}); a torch.save pickle is stored, at most "
                                  f"{cap} bytes")
        with z.open(info) as f:
            data = f.read(cap + 1)
        if len(data) > cap:
            raise CheckpointError(f"{self.path}: record {describe(info.filename, 80)} inflates past {cap} bytes")
        return data

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self._size

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
            raise CheckpointError(f"{self.path}: the pickle names storage {key}, which the file lacks (truncated?)")
        item = torch.empty((), dtype=dtype).element_size()
        if numel * item > info.file_size:
            raise CheckpointError(f"{self.path}: storage {key} holds {info.file_size} bytes, not {numel} x {item}")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=self._data_offset(info))

    def load(self) -> Any:
        """Unpickles the file's object with the allowlist; tensors are views of the mapping."""
        return _run_unpickler(_RestrictedUnpickler(self._pickle, str(self.path), self.storage), str(self.path))

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


def restricted_loads(data: bytes, where: str, allowed: dict[str, Any]) -> Any:
    """Unpickles a plain pickle (no tensor storages) accepting only the globals in ``allowed``
    (``"module.name"`` -> what it unpickles to: a :class:`PickleStandIn` subclass or a checking function).

    Raises:
        UnsafePickleError: naming the first other global (nothing is executed).
        CheckpointError: a malformed pickle, naming ``where``.
    """
    if len(data) > _MAX_PICKLE:
        raise CheckpointError(f"{where}: a pickle of {len(data)} bytes, more than {_MAX_PICKLE}")
    return _run_unpickler(_RestrictedUnpickler(data, where, None, allowed), where)


def _run_unpickler(unpickler: _RestrictedUnpickler, where: str) -> Any:
    try:
        return unpickler.load()
    except CheckpointError as e:
        if str(e).startswith(where):
            raise
        raise type(e)(f"{where}: {e}") from None
    except Exception as e:  # a malformed pickle: name the file, not pickle's internals
        # NOTE: str(e) only when its arguments are plain: a KeyError's text is the repr of a crafted key.
        text = str(e)[:200] if all(type(a) in (str, int) for a in e.args) else ""
        raise CheckpointError(f"{where}: cannot read the pickle ({type(e).__name__}{': ' if text else ''}"
                              f"{text})") from None


def load_torch_zip_bytes(blob: bytes | memoryview, where: str) -> Any:
    """A ``torch.save`` zip held in memory (one record of a container file, as DCP writes them), through the
    allowlist: every record stored and inside ``blob``, the pickle capped; tensors are views of ``blob``'s copy.

    Raises:
        UnsafePickleError / CheckpointError: naming ``where``.
    """
    blob = bytes(blob)
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            infos = z.infolist()
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(blob):
                    raise CheckpointError(f"{where}: record {describe(info.filename, 80)} is compressed or larger "
                                          f"than the {len(blob)} bytes it lies in; torch.save stores its records")
            pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pkl) != 1:
                raise CheckpointError(f"{where}: a zip record but not a torch.save one (no data.pkl)")
            prefix = pkl[0].filename[: -len("data.pkl")]
            if pkl[0].file_size > _MAX_PICKLE:
                raise CheckpointError(f"{where}: a pickle of {pkl[0].file_size} bytes, more than {_MAX_PICKLE}")
            pickled = z.read(pkl[0])
            view = memoryview(blob)
            # the records' bytes in place (zipfile's read would copy each and recompute its CRC)
            records = {i.filename: view[start:start + i.file_size] for i in infos
                       if i.filename.startswith(prefix + "data/") and (start := _record_start(blob, i, where)) >= 0}
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
            RuntimeError) as e:
        raise CheckpointError(f"{where}: not a complete torch.save record ({str(e)[:200]}); the file is truncated "
                              "or was edited") from None

    def storage(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        data = records.get(f"{prefix}data/{key}")
        if data is None:
            raise CheckpointError(f"{where}: the pickle names storage {key}, which the record lacks (truncated?)")
        item = torch.empty((), dtype=dtype).element_size()
        if numel * item > len(data):
            raise CheckpointError(f"{where}: storage {key} holds {len(data)} bytes, not {numel} x {item}")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype, count=numel)  # one copy: writable, owned

    return _run_unpickler(_RestrictedUnpickler(pickled, where, storage), where)


def _record_start(blob: bytes, info: zipfile.ZipInfo, where: str) -> int:
    """Where stored record ``info``'s bytes begin in ``blob`` (after its local header), checked to end inside it."""
    header = blob[info.header_offset: info.header_offset + 30]
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise CheckpointError(f"{where}: broken zip local header for {describe(info.filename, 80)}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > len(blob):
        raise CheckpointError(f"{where}: record {describe(info.filename, 80)} runs past the end (truncated)")
    return start
