"""Nested state (optimizer state, RNG state, scaler state) as a JSON skeleton plus tensors.

Every JSON object in the skeleton is a tagged node, so plain values, lists and tagged nodes never
collide: ``{"dict": [[key, value], ...]}`` keeps non-string keys (int parameter ids) and key order,
``{"tuple": [...]}`` keeps tuples, ``{"tensor": "t0"}`` points into the safetensors file,
``{"ndarray": "t1", "dtype": "<u4", "shape": [624]}`` keeps any numpy array bit-exactly (its raw
bytes are stored as uint8), ``{"npscalar": "<f8", "hex": "..."}`` keeps numpy scalars and
``{"torch_dtype": "bfloat16"}`` keeps dtypes. Floats go through ``repr`` (exact, incl. nan/inf/-0.0).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .format import CheckpointError

__all__ = ["decode_state", "encode_state"]


class _Encoder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.tensors: dict[str, torch.Tensor] = {}
        self._memo: dict[int, str] = {}  # id(tensor) -> storage key: the same object is stored once

    def _store(self, t: torch.Tensor) -> str:
        key = self._memo.get(id(t))
        if key is None:
            key = f"t{len(self.tensors)}"
            self.tensors[key] = t
            self._memo[id(t)] = key
        return key

    def encode(self, v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and not isinstance(v, np.generic):
            return int(v)
        if isinstance(v, float) and not isinstance(v, np.generic):
            return {"float": repr(float(v))} if not math.isfinite(v) else float(v)
        if isinstance(v, torch.Tensor):
            if v.is_sparse or v.layout != torch.strided:
                raise CheckpointError(f"{self.name}: {path}: sparse tensors are not supported; call .to_dense()")
            return {"tensor": self._store(v)}
        if isinstance(v, np.ndarray):
            if v.dtype.hasobject:
                raise CheckpointError(f"{self.name}: {path}: numpy arrays of Python objects cannot be stored")
            raw = torch.from_numpy(np.ascontiguousarray(v).reshape(-1).view(np.uint8).copy())
            return {"ndarray": self._store(raw), "dtype": v.dtype.str, "shape": list(v.shape)}
        if isinstance(v, np.generic):
            return {"npscalar": v.dtype.str, "hex": v.tobytes().hex()}
        if isinstance(v, torch.dtype):
            return {"torch_dtype": str(v).removeprefix("torch.")}
        if isinstance(v, dict):
            return {"dict": [[self._key(k, path), self.encode(x, f"{path}.{k}")] for k, x in v.items()]}
        if isinstance(v, tuple):  # incl. torch.Size, which comes back as a plain tuple
            return {"tuple": [self.encode(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.encode(x, f"{path}[{i}]") for i, x in enumerate(v)]
        raise CheckpointError(
            f"{self.name}: {path}: values of type {type(v).__name__} cannot be stored; use tensors, numpy arrays, "
            "numbers, str, bool, None, and dict/list/tuple of them (no pickle, by design)")

    def _key(self, k: Any, path: str) -> Any:
        if isinstance(k, (torch.Tensor, np.ndarray, dict, list)):
            raise CheckpointError(f"{self.name}: {path}: dict key {k!r} must be a str, number, bool, None or tuple")
        return self.encode(k, path)


def encode_state(obj: Any, name: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """Splits ``obj`` into a JSON-able skeleton and a flat dict of tensors to store."""
    enc = _Encoder(name)
    return enc.encode(obj, name), enc.tensors


# Only dtypes decode: a name is looked up here, never through getattr(torch, name) (which would hand
# back any torch attribute, e.g. torch.load, to code that then calls it).
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def decode_state(node: Any, tensors: dict[str, torch.Tensor], name: str = "state") -> Any:
    """Inverse of :func:`encode_state`.

    Raises:
        CheckpointError: naming ``name`` and the node, for any malformed or unknown node.
    """
    try:
        return _decode(node, tensors, name)
    except CheckpointError:
        raise
    except (KeyError, ValueError, TypeError, IndexError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"{name}: malformed skeleton ({type(e).__name__}: {str(e)[:200]}); the state file is "
                              "corrupt") from None


def _decode(node: Any, tensors: dict[str, torch.Tensor], name: str) -> Any:
    if node is None or isinstance(node, (bool, str, int, float)):
        return node
    if isinstance(node, list):
        return [_decode(x, tensors, name) for x in node]
    if not isinstance(node, dict) or len(node) == 0:
        raise CheckpointError(f"{name}: malformed skeleton node {node!r:.80}")
    if "dict" in node:
        return {_hashable(_decode(k, tensors, name)): _decode(v, tensors, name) for k, v in node["dict"]}
    if "tuple" in node:
        return tuple(_decode(x, tensors, name) for x in node["tuple"])
    if "tensor" in node:
        return _tensor(tensors, node["tensor"], name)
    if "ndarray" in node:
        raw = _tensor(tensors, node["ndarray"], name)
        if raw.dtype != torch.uint8 or raw.dim() != 1:
            raise CheckpointError(f"{name}: ndarray node points to a {raw.dtype} tensor, expected 1-D uint8 bytes")
        return raw.numpy().view(_np_dtype(node["dtype"], name)).reshape(node["shape"]).copy()
    if "npscalar" in node:
        dtype = _np_dtype(node["npscalar"], name)
        data = bytes.fromhex(node["hex"])
        if len(data) != dtype.itemsize:
            raise CheckpointError(f"{name}: numpy scalar of {dtype} holds {len(data)} bytes, not {dtype.itemsize}")
        return np.frombuffer(data, dtype=dtype)[0]
    if "float" in node:
        return float(node["float"])
    if "torch_dtype" in node:
        dtype = _TORCH_DTYPES.get(node["torch_dtype"]) if isinstance(node["torch_dtype"], str) else None
        if dtype is None:
            raise CheckpointError(f"{name}: torch_dtype {node['torch_dtype']!r:.60} is not a torch dtype name "
                                  f"(e.g. 'float32', 'bfloat16')")
        return dtype
    raise CheckpointError(f"{name}: unknown skeleton node {sorted(node)!r:.80}")


def _tensor(tensors: dict[str, torch.Tensor], key: Any, name: str) -> torch.Tensor:
    if not isinstance(key, str) or key not in tensors:
        raise CheckpointError(f"{name}: skeleton refers to tensor {key!r:.60} that is not in the safetensors file")
    return tensors[key]


def _np_dtype(spec: Any, name: str) -> np.dtype:
    """A numpy dtype from its ``.str`` (``"<f8"``); object and structured dtypes are refused."""
    if not isinstance(spec, str) or len(spec) > 16:
        raise CheckpointError(f"{name}: numpy dtype {spec!r:.60} is not a dtype string")
    try:
        dtype = np.dtype(spec)
    except TypeError:
        raise CheckpointError(f"{name}: numpy dtype {spec!r:.60} is not a dtype string") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biufcmMSU":
        raise CheckpointError(f"{name}: numpy dtype {spec!r} is not a plain numeric dtype")
    return dtype


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, (list, tuple)) else k
