"""Reading a torch.distributed.checkpoint (DCP) directory region by region, and seeing it as a shardkit checkpoint.

:class:`DCPReader` reads any box or flat range of a saved tensor from the chunks that cover it (one rank's
shard at a time, never the whole model), and the non-tensor values through the restricted unpickler.
:class:`DCPLayout` says where the model and optimizer lie in the saved state dict, in either layout torch
writes:

* ``torch``: ``dcp.save({"model": model_sd, "optimizer": optim_sd})`` with ``get_state_dict``'s structure
  (``model.<fqn>``, ``optimizer.state.<fqn>.<key>``, ``optimizer.param_groups.<i>.<hyper>``);
* ``torchtitan``: the model's FQNs at the top, ``optimizer`` flattened by ``flatten_optimizer_state_dict``
  (``state.<fqn>.<key>``, ``param_groups.<fqn>.<hyper>``), beside ``train_state``, ``lr_scheduler`` and
  ``dataloader``.

:class:`DCPCheckpointView` answers the reads a strategy's ``load_module``/``load_optimizer`` make of a
:class:`~shardkit.checkpoint.CheckpointReader` (the model as sharded entry ``model``, the optimizer as the
sharded entry ``optimizer`` with its ``optimizer.meta``), so ``Runner.load`` resumes a DCP directory under
every strategy and world size by the same code that resumes shardkit's own sharded saves: each rank reads
only the boxes its shards cover.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .assemble import read_region
from .dcp_metadata import DCP_METADATA, DCPIndex, DCPTensor, read_dcp_index
from .format import CheckpointError, dtype_tag
from .safe_unpickle import load_torch_zip_bytes
from .trust import describe, open_regular

__all__ = ["DCPCheckpointView", "DCPLayout", "DCPReader", "MODEL", "OPTIMIZER"]

MODEL, OPTIMIZER = "model", "optimizer"
_SEP = "/"  # shardkit's "<fqn>/<state key>" optimizer keys
_TOPS = ("optimizer", "lr_scheduler", "dataloader", "train_state")
_ZIP = b"PK\x03\x04"


class DCPReader:
    """Region reads of one DCP directory, checked against its index (see :mod:`.dcp_metadata`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.index: DCPIndex = read_dcp_index(self.path)
        self._cache: tuple[tuple, torch.Tensor] | None = None

    def _bytes(self, file: str, offset: int, length: int) -> bytes:
        fd = open_regular(self.path / file, "a DCP data file", size=self.index.files[file])
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise CheckpointError(f"{self.path / file}: ends before byte {offset + length} (truncated?)")
        return data

    def _chunk(self, t: DCPTensor, i: int) -> torch.Tensor:
        c = t.chunks[i]
        ident = (t.key, i)
        if self._cache is not None and self._cache[0] == ident:
            return self._cache[1]
        where = f"{self.path / c.file}: {t.key} chunk at {list(c.offsets)}"
        value = load_torch_zip_bytes(self._bytes(c.file, c.offset, c.length), where)
        if not isinstance(value, torch.Tensor) or value.dtype != t.dtype or tuple(value.shape) != c.sizes:
            got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else describe(value)
            raise CheckpointError(f"{where}: holds {got}, the metadata says {t.dtype} {list(c.sizes)}")
        self._cache = (ident, value)
        return value

    def tensor(self, key: str) -> DCPTensor:
        t = self.index.tensors.get(key)
        if t is None:
            raise CheckpointError(f"{self.path / DCP_METADATA}: has no tensor {key!r}")
        return t

    def _region(self, key: str, **region: Any) -> torch.Tensor:
        t = self.tensor(key)
        entry = {"shape": list(t.shape), "dtype": dtype_tag(t.dtype, key),
                 "pieces": [{"offsets": list(c.offsets), "shape": list(c.sizes), "file": c.file, "tensor": str(i)}
                            for i, c in enumerate(t.chunks)]}

        def get(_file: str, chunk: str, slices: tuple | None) -> torch.Tensor:
            data = self._chunk(t, int(chunk))
            return data if slices is None else data[slices]

        return read_region(get, entry, f"{self.path}: {key}", **region)

    def read_box(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)`` of tensor ``key``, from the chunks covering it."""
        t = self.tensor(key)
        exact = next((i for i, c in enumerate(t.chunks) if c.offsets == tuple(offsets) and c.sizes == tuple(shape)),
                     None)
        if exact is not None:  # one chunk is the box (a resume at the saved layout, a whole tensor): no assembly
            return self._chunk(t, exact).clone()  # the caller owns it (a loaded optimizer state is updated in place)
        return self._region(key, box=(tuple(offsets), tuple(shape)))

    def read_flat_range(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the row-major flattened tensor ``key``."""
        return self._region(key, flat=(start, end))

    def read_full(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``."""
        t = self.tensor(key)
        return self.read_box(key, (0,) * len(t.shape), t.shape)

    def read_value(self, key: str) -> Any:
        """A non-tensor value: a pickled Python value (through the allowlist), or the raw bytes of a ``BytesIO``."""
        item = self.index.items.get(key)
        if item is None:
            if key in self.index.tensors:
                return self.read_full(key)
            raise CheckpointError(f"{self.path / DCP_METADATA}: has no value {key!r}")
        data = self._bytes(item.file, item.offset, item.length)
        return load_torch_zip_bytes(data, f"{self.path / item.file}: {key}") if data[:4] == _ZIP else data


class DCPLayout:
    """Where the model, the optimizer and the rest lie in a DCP checkpoint's keys (see the module docstring)."""

    def __init__(self, index: DCPIndex) -> None:
        self.model: dict[str, str] = {}  # fqn -> key
        self.state: dict[str, dict[str, str]] = {}  # fqn -> state key -> key
        self.groups: dict[int, dict[str, str]] = {}  # torch layout: group index -> hyperparameter -> key
        self.param_hypers: dict[str, dict[str, str]] = {}  # torchtitan layout: fqn -> hyperparameter -> key
        self.train_state: dict[str, str] = {}
        self.other: dict[str, list[str]] = {}  # top-level name -> keys not read into a shardkit run
        top_tensors: dict[str, str] = {}
        for key, path in index.paths.items():
            if len(path) == 1 and key in index.tensors and path[0] not in _TOPS:
                top_tensors[str(path[0])] = key
            else:
                self._place(key, path)
        # torchtitan keeps the model's tensors at the top level; beside a `model` entry they are something else
        self.style = "torch" if self.model else "torchtitan"
        if self.model:
            self.other.update({"(top level)": list(top_tensors.values())} if top_tensors else {})
        else:
            self.model = top_tensors

    def _place(self, key: str, path: tuple) -> None:
        top = path[0]
        if top == MODEL and len(path) >= 2 and all(type(p) is str for p in path[1:]):
            self.model[".".join(path[1:])] = key
        elif top == OPTIMIZER and len(path) == 4 and path[1] == "state" and type(path[2]) is type(path[3]) is str:
            self.state.setdefault(path[2], {})[path[3]] = key
        elif top == OPTIMIZER and len(path) == 4 and path[1] == "param_groups" and type(path[2]) is int:
            self.groups.setdefault(path[2], {})[str(path[3])] = key
        elif top == OPTIMIZER and len(path) == 2 and type(path[1]) is str and path[1].count(".") >= 2 and \
                path[1].split(".", 1)[0] in ("state", "param_groups"):
            kind, rest = path[1].split(".", 1)
            fqn, name = rest.rsplit(".", 1)
            (self.state if kind == "state" else self.param_hypers).setdefault(fqn, {})[name] = key
        elif top == "train_state" and len(path) == 2:
            self.train_state[str(path[1])] = key
        else:
            self.other.setdefault(str(top), []).append(key)


class DCPCheckpointView:
    """A DCP directory answering the reads ``Runner.load`` makes of a shardkit checkpoint (read-only).

    Entries: ``model`` and ``optimizer`` (sharded, as FSDP saves them), ``optimizer.meta``, ``entries``,
    ``values`` (empty), ``precision`` (empty: DCP keeps no loss scale) and ``runner`` (the optimizer steps from
    ``train_state.step``, else from the optimizer's step count). What has no shardkit counterpart (a data
    loader's or scheduler's state) is listed by :attr:`unread`.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True) -> None:
        del verify  # DCP records no hashes; sizes and shapes are checked on every read
        self.reader = DCPReader(path)
        self.path = self.reader.path
        self.layout = DCPLayout(self.reader.index)
        self.world_size = max(1, len(self.reader.index.files))
        self._meta: dict[str, Any] | None = None
        if not self.layout.model:
            raise CheckpointError(f"{self.path}: a DCP checkpoint with no model weights (its top-level names: "
                                  f"{sorted({str(p[0]) for p in self.reader.index.paths.values()})[:8]})")

    def __enter__(self) -> DCPCheckpointView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing is held open between reads."""

    @property
    def unread(self) -> dict[str, list[str]]:
        """Top-level names whose keys a shardkit run does not take (data loader, scheduler, ...)."""
        return dict(self.layout.other)

    def entries(self) -> dict[str, str]:
        out = {"entries": "json", "values": "state", "precision": "json", "runner": "json", MODEL: "sharded"}
        if self.layout.state:
            out.update({OPTIMIZER: "sharded", f"{OPTIMIZER}.meta": "state"})
        return out

    def has(self, name: str) -> bool:
        return name in self.entries()

    def _key(self, name: str, key: str) -> str:
        if name == MODEL and key in self.layout.model:
            return self.layout.model[key]
        if name == OPTIMIZER and _SEP in key:
            fqn, k = key.rsplit(_SEP, 1)
            found = self.layout.state.get(fqn, {}).get(k)
            if found is not None and found in self.reader.index.tensors:
                return found
        raise CheckpointError(f"{self.path}: entry {name!r} has no tensor {key!r}")

    def sharded_keys(self, name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        tensors = self.reader.index.tensors
        if name == MODEL:
            return {fqn: (tensors[k].shape, tensors[k].dtype) for fqn, k in self.layout.model.items()
                    if k in tensors}
        if name == OPTIMIZER:
            return {f"{fqn}{_SEP}{s}": (tensors[k].shape, tensors[k].dtype) for fqn, st in self.layout.state.items()
                    for s, k in st.items() if k in tensors and tensors[k].shape}
        raise CheckpointError(f"{self.path}: has no sharded entry {name!r}; it has {sorted(self.entries())}")

    def read_box(self, name: str, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        return self.reader.read_box(self._key(name, key), offsets, shape)

    def read_flat_range(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        return self.reader.read_flat_range(self._key(name, key), start, end)

    def read_full(self, name: str, key: str) -> torch.Tensor:
        return self.reader.read_full(self._key(name, key))

    def iter_full_tensors(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.sharded_keys(name):
            yield key, self.read_full(name, key)

    def read_json(self, name: str, check: Callable[[Any, Path], Any] | None = None) -> Any:
        if name == "entries":
            value: Any = {k: v for k, v in ((MODEL, "module"), (OPTIMIZER, "optimizer")) if self.has(k)}
        elif name == "precision":
            value = {}
        elif name == "runner":
            value = {"micro_step": 0, "boundary": False, "optimizer_steps": self._steps()}
        else:
            raise CheckpointError(f"{self.path}: has no JSON entry {name!r}")
        return value if check is None else check(value, self.path / DCP_METADATA)

    def read_state(self, name: str) -> Any:
        if name == "values":
            return {}
        if name == f"{OPTIMIZER}.meta" and self.layout.state:
            return self.optimizer_meta()
        raise CheckpointError(f"{self.path}: has no state entry {name!r}")

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        raise CheckpointError(f"{self.path}: entry {name!r} is sharded, not a tensors entry")

    def _steps(self) -> int:
        key = self.layout.train_state.get("step")
        value = self.reader.read_value(key) if key is not None else self.optimizer_meta()["step"]
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1 << 40:
            raise CheckpointError(f"{self.path}: train_state.step is {describe(value)}, not a step count")
        return int(value)

    def optimizer_meta(self) -> dict[str, Any]:
        """``optimizer.meta`` as shardkit's sharded saves write it: param groups with parameter names, per-name
        scalars (Adam's ``step``) and tensor keys, and the step count."""
        if self._meta is not None:
            return self._meta
        tensors = self.reader.index.tensors
        scalars: dict[str, dict[str, Any]] = {}
        keys: dict[str, list[str]] = {}
        for fqn, st in self.layout.state.items():
            keys[fqn] = sorted(k for k, key in st.items() if key in tensors and tensors[key].shape)
            scalars[fqn] = {k: self.reader.read_value(key) for k, key in st.items() if k not in keys[fqn]}
        step = next((s["step"] for s in scalars.values() if "step" in s), 0)
        step = int(step.item() if isinstance(step, torch.Tensor) else step)
        self._meta = {"param_groups": self._param_groups(), "scalars": scalars, "tensor_keys": keys, "step": step,
                      "state_keys": sorted({k for ks in keys.values() for k in ks}), "loss_scaler": {}}
        return self._meta

    def regroup(self, name: str, groups: list[list[str]]) -> None:
        """Groups the optimizer's parameters as ``groups`` (the names in each param group of the optimizer being
        loaded). torchtitan's layout keeps each parameter's hyperparameters but not the groups, so without this
        parameters with equal ones form one group, and an optimizer with two such groups would be refused. Done
        only when the names are exactly the saved ones; each group's parameters must have been saved with equal
        hyperparameters.

        Raises:
            CheckpointError: two parameters of one group were saved with different hyperparameters.
        """
        hypers = self.layout.param_hypers
        if name != OPTIMIZER or self.layout.groups or not hypers or \
                sorted(n for g in groups for n in g) != sorted(hypers):
            return  # torch's layout records its groups; other names are the loader's to refuse, by name
        read, out = self.reader.read_value, []
        for i, names in enumerate(groups):
            values = [{h: read(k) for h, k in sorted(hypers[n].items())} for n in names]
            odd = next((j for j, v in enumerate(values) if v != values[0]), None)
            if odd is not None:
                raise CheckpointError(f"{self.path}: parameters {names[0]!r} and {names[odd]!r} are in param group "
                                      f"{i} of the optimizer being loaded, but were saved with different "
                                      f"hyperparameters ({values[0]} and {values[odd]}); build the optimizer's "
                                      "groups as the saved run did")
            out.append({**(values[0] if values else {}), "params": list(names)})
        self.optimizer_meta()["param_groups"] = out

    def _param_groups(self) -> list[dict[str, Any]]:
        lay, read = self.layout, self.reader.read_value
        if lay.groups:
            groups = [{h: read(k) for h, k in lay.groups[i].items()} for i in sorted(lay.groups)]
            for i, g in enumerate(groups):
                if not isinstance(g.get("params"), list) or not all(isinstance(p, str) for p in g["params"]):
                    raise CheckpointError(f"{self.path}: optimizer param_groups[{i}].params is "
                                          f"{describe(g.get('params'))}, not a list of parameter names")
            return groups
        # torchtitan: hyperparameters per parameter; parameters with equal ones form one group, in saved order
        merged: list[dict[str, Any]] = []
        for fqn in lay.state:
            hypers = {h: read(k) for h, k in sorted(lay.param_hypers.get(fqn, {}).items())}
            same = next((g for g in merged if {h: v for h, v in g.items() if h != "params"} == hypers), None)
            if same is None:
                merged.append({**hypers, "params": [fqn]})
            else:
                same["params"].append(fqn)
        return merged
