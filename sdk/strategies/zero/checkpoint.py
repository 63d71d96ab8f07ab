"""ZeRO checkpoints in shardkit's one format, through DeepSpeed's fragment APIs (no DeepSpeed pickles).

Layout, for a module entry ``model`` and an optimizer entry ``optimizer``:

* ``model`` (sharded): one key per parameter name (the fp32 master weights) and per persistent
  buffer. Each rank writes the flat fragment of every parameter it owns as a ``ShardPiece`` with
  ``flat_range``: under ZeRO-3 the rank's partition ``[r*p, min((r+1)*p, numel))`` of the flattened
  parameter (DeepSpeed pads the last partition at its end; the padding is not written); under
  ZeRO-1/2 the fragment DeepSpeed's ``_hp_mapping`` says the rank updates (which fragment is the stage's
  :class:`~shardkit.strategies.zero.layout.ZeROLayout`). Buffers are written whole by rank 0, and so are
  parameters that no optimizer holds, except under ZeRO-3, where each rank writes its partition of them.
* ``optimizer`` (sharded): keys ``<param name>/<state key>`` (``exp_avg``, ``exp_avg_sq``, ...),
  fragments as above, and ``optimizer.meta`` (state): the step count, the param groups'
  hyperparameters (lr, betas, ...) with their parameters' names, the DeepSpeed loss scaler's state,
  and per name the ``scalars``/``tensor_keys`` of the FSDP/TP layout, so every strategy's loader reads it.

Loading reads each rank's own range with ``read_flat_range``, so a save made on any world size and
any stage (or a full save from DDP/SingleDevice) loads on any other. Everything is checked against
the checkpoint before the first tensor is written.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardkit import checkpoint as ckpt
from shardkit.strategies.zero.layout import ZeROLayout, inner_optimizer, param_shape

__all__ = ["load_full_optimizer", "load_module", "load_optimizer", "named_groups", "save_module", "save_optimizer"]

_META = "{}.meta"
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_factor", "scale_window")


def _piece(tensor: torch.Tensor, shape: tuple[int, ...], flat: tuple[int, int]) -> ckpt.ShardPiece:
    return ckpt.ShardPiece(tensor.detach().reshape(-1).float().cpu().clone(), shape, flat_range=flat)


# ---- module -------------------------------------------------------------------------------------


def save_module(writer: ckpt.CheckpointWriter, name: str, module: nn.Module, layout: ZeROLayout, rank: int) -> None:
    """Every rank writes its fp32 fragments; rank 0 adds the buffers (and, below ZeRO-3, the frozen parameters)."""
    pieces: dict[str, ckpt.ShardPiece] = {}
    for pname, param in module.named_parameters():
        if layout.trainable(param):
            found = layout.fragment(param, None)
        else:
            found = layout.frozen_piece(param, rank)
        if found is not None:
            pieces[pname] = _piece(found[0], param_shape(param), found[1])
    if rank == 0:
        for bname, buf in _persistent_buffers(module):
            pieces[bname] = ckpt.ShardPiece(buf.detach().cpu().clone(), tuple(buf.shape), offsets=(0,) * buf.dim())
    writer.write_shard(name, pieces)


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    keys = set(module.state_dict().keys())
    return [(n, b) for n, b in module.named_buffers() if n in keys]


def _check_keys(reader: ckpt.CheckpointReader, name: str, wanted: dict[str, tuple[int, ...]]) -> None:
    """Fail before anything is written when a key is missing or has another shape."""
    saved = reader.sharded_keys(name)
    for key, shape in wanted.items():
        if key not in saved:
            raise ckpt.CheckpointError(f"{reader.path}: entry {name!r} has no tensor {key!r} (it has {len(saved)} "
                                       "keys); the model changed since the save")
        if math.prod(saved[key][0]) != math.prod(shape):
            raise ckpt.CheckpointError(f"{reader.path}: {name}/{key} was saved with shape {list(saved[key][0])}, "
                                       f"the model has {list(shape)}")


def load_module(reader: ckpt.CheckpointReader, name: str, module: nn.Module, layout: ZeROLayout,
                optimizer: Any) -> None:
    """Fill each rank's fp32 fragments and low-precision copies from any shardkit save of the module."""
    params = list(module.named_parameters())
    buffers = _persistent_buffers(module)
    _check_keys(reader, name, {**{n: param_shape(p) for n, p in params}, **{n: tuple(b.shape) for n, b in buffers}})
    for pname, param in params:
        layout.load_parameter(reader, name, pname, param)
    for bname, buf in buffers:
        buf.data.copy_(reader.read_full(name, bname).to(buf.dtype))
    layout.after_module_load(optimizer)


# ---- optimizer ----------------------------------------------------------------------------------


def _state_keys(optimizer: Any) -> list[str]:
    """Per-element state keys of the inner optimizer (exp_avg, exp_avg_sq, ...), from its first state."""
    inner = inner_optimizer(optimizer)
    for state in inner.state.values():
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() > 1)
    return []


def _step_count(optimizer: Any) -> int:
    for state in inner_optimizer(optimizer).state.values():
        step = state.get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)
    return 0


def save_optimizer(writer: ckpt.CheckpointWriter, name: str, optimizer: Any, module: nn.Module, layout: ZeROLayout,
                   rank: int) -> None:
    """Every rank writes its optimizer-state fragments; rank 0 writes the step, groups and loss scaler."""
    keys = _state_keys(optimizer)
    pieces: dict[str, ckpt.ShardPiece] = {}
    for pname, param in module.named_parameters():
        if not layout.trainable(param):
            continue
        for key in keys:
            found = layout.fragment(param, key, optimizer)
            if found is not None:
                pieces[f"{pname}/{key}"] = _piece(found[0], param_shape(param), found[1])
    writer.write_shard(name, pieces)
    if rank == 0:
        groups = named_groups(optimizer, module, layout)
        step = _step_count(optimizer)
        scaler = getattr(optimizer, "loss_scaler", None)
        scaler_state = {f: getattr(scaler, f) for f in _SCALER_FIELDS if hasattr(scaler, f)}
        # "scalars" and "tensor_keys" are the layout of the FSDP/TP saves (strategies/_sharded_state.py),
        # so that the base hooks of SingleDevice/DDP and FSDP's loader read a ZeRO save as well.
        trainable = [n for g in groups for n in g["params"]]
        meta = {"step": step, "param_groups": groups, "state_keys": keys, "loss_scaler": scaler_state,
                "stage": layout.stage, "scalars": {n: {"step": torch.tensor(float(step))} for n in trainable},
                "tensor_keys": {n: keys for n in trainable}}
        writer.write_state(_META.format(name), meta)


def named_groups(optimizer: Any, module: nn.Module, layout: ZeROLayout) -> list[dict[str, Any]]:
    """The param groups' hyperparameters with ``params`` as the names of the model parameters in each group."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer.param_groups]
    for index, params in layout.group_params(optimizer):
        groups[index]["params"].extend(names[id(p)] for p in params)
    return groups


class _FullOptimizerState:
    """Reads a full by-name optimizer state (saved by DDP/SingleDevice, or read from another tool's file) like a
    sharded entry."""

    def __init__(self, nested: dict[str, Any]):
        self.state = nested["state"]
        keys = sorted({k for st in self.state.values() for k, v in st.items()
                       if isinstance(v, torch.Tensor) and v.dim() > 0})
        self.meta = {"param_groups": nested["param_groups"], "loss_scaler": {}, "state_keys": keys or None,
                     "step": next((int(s["step"]) for s in self.state.values() if "step" in s), 0)}

    def has(self, pname: str, key: str) -> bool:
        return key in self.state.get(pname, {})

    def flat(self, pname: str, key: str, start: int, end: int) -> torch.Tensor:
        return self.state[pname][key].reshape(-1)[start:end]


class _ShardedOptimizerState:
    def __init__(self, reader: ckpt.CheckpointReader, name: str):
        self.reader, self.name = reader, name
        self.keys = reader.sharded_keys(name)
        self.meta = reader.read_state(_META.format(name))

    def has(self, pname: str, key: str) -> bool:
        return f"{pname}/{key}" in self.keys

    def flat(self, pname: str, key: str, start: int, end: int) -> torch.Tensor:
        return self.reader.read_flat_range(self.name, f"{pname}/{key}", start, end)


def load_optimizer(reader: ckpt.CheckpointReader, name: str, optimizer: Any, module: nn.Module,
                   layout: ZeROLayout) -> None:
    """Fill each rank's optimizer-state fragments, then the step count, the groups and the loss scaler."""
    kind = reader.entries().get(name)
    source = _ShardedOptimizerState(reader, name) if kind == "sharded" else _FullOptimizerState(reader.read_state(name))
    _load_optimizer_from(source, f"{reader.path}: optimizer entry {name!r}", optimizer, module, layout)


def load_full_optimizer(nested: dict[str, Any], optimizer: Any, module: nn.Module, layout: ZeROLayout) -> None:
    """A whole-tensor optimizer state keyed by parameter name (``optimizer_state_by_name``'s structure) into each
    rank's fragments, as a full save loads."""
    _load_optimizer_from(_FullOptimizerState(nested), "the optimizer state", optimizer, module, layout)


def _load_optimizer_from(source: Any, where: str, optimizer: Any, module: nn.Module, layout: ZeROLayout) -> None:
    if not inner_optimizer(optimizer).state:
        _create_state(optimizer, layout, source.meta.get("state_keys") or ["exp_avg", "exp_avg_sq"])
    keys = _state_keys(optimizer)
    trainable = [(n, p) for n, p in module.named_parameters() if layout.trainable(p)]
    missing = [f"{n}/{k}" for n, _ in trainable for k in keys if not source.has(n, k)]
    if missing:
        raise ckpt.CheckpointError(f"{where} has no state {missing[0]!r} ({len(missing)} missing); it was saved "
                                   "for another model or optimizer")
    if len(source.meta["param_groups"]) != len(optimizer.param_groups):
        raise ckpt.CheckpointError(f"{where} has {len(source.meta['param_groups'])} param groups, this optimizer "
                                   f"has {len(optimizer.param_groups)}")
    for pname, param in trainable:
        for key in keys:
            layout.load_state(source, pname, param, key, optimizer)
    _load_meta(optimizer, source.meta)


def _create_state(optimizer: Any, layout: ZeROLayout, keys: list[str]) -> None:
    """Create the optimizer's per-partition state (zeros, step 0) that a fresh engine lacks.

    Adam creates its state at the first step and DeepSpeed links the per-parameter fragments to it
    then (stage 1/2) or looks it up per step (stage 3); a load before that step would otherwise find
    nothing to fill, and the first resumed step would start from fresh moments.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = inner_optimizer(optimizer)
    # DeepSpeedCPUAdam counts steps in a Python int (passed to its C++ kernel); torch's Adam in a 0-d tensor.
    step = 0 if isinstance(inner, DeepSpeedCPUAdam) else None
    for index, flat in enumerate(layout.master_partitions(optimizer)):
        layout.check_state_creatable(optimizer, index)
        inner.state[flat] = {"step": torch.tensor(0.0) if step is None else step,
                             **{k: torch.zeros_like(flat) for k in keys}}
    layout.link_state(optimizer)


def _load_meta(optimizer: Any, meta: dict[str, Any]) -> None:
    for state in inner_optimizer(optimizer).state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = torch.tensor(float(meta["step"]), dtype=old.dtype) if isinstance(old, torch.Tensor) \
                else type(old)(meta["step"])
    for live, saved in zip(optimizer.param_groups, meta["param_groups"]):
        live.update({k: v for k, v in saved.items() if k != "params"})
    scaler = getattr(optimizer, "loss_scaler", None)
    for field_name, value in meta.get("loss_scaler", {}).items():
        if hasattr(scaler, field_name):
            setattr(scaler, field_name, value)
