"""Saving and loading DTensor-sharded modules and optimizer state in shardkit's checkpoint format.

Two layouts, one per ``state_dict_type``:

* sharded: every rank writes its local shards with ``CheckpointWriter.write_shard`` as boxes
  (``ShardPiece(local, global_shape, offsets=...)``; a strided shard, as tensor parallelism inside the experts makes
  of a stacked gate/up weight, as one piece per box). Replicas (ranks whose coordinate on a
  ``Replicate`` mesh dimension is not 0) write nothing, so each box is stored once. Plain
  (non-DTensor) tensors are written whole by rank 0. The optimizer's tensors go into the entry
  ``<name>`` keyed ``<param FQN>/<state key>``, and its param groups and scalar state (Adam's
  ``step``) into ``<name>.meta``, written by rank 0.
* full: every tensor is gathered (one at a time) and rank 0 writes the same entries a replicated
  strategy writes (``write_tensors`` for modules, ``optimizer_state_by_name`` for optimizers), so
  SingleDevice and DDP load them with the base hooks.

Loading reads, for each local shard, exactly the box it covers from whichever layout was saved
(``CheckpointReader.read_box`` assembles it from any pieces), so a checkpoint saved on N ranks loads
on M ranks and under a different strategy. A strategy whose shards are flat ranges (ZeRO) can reuse
:func:`write_pieces` and :func:`read_optimizer_meta` with ``ShardPiece(flat_range=...)`` pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from shardkit import checkpoint as ckpt
from shardkit.strategies._dtensor import dtensor_boxes, local_part, local_tensor

__all__ = [
    "is_primary_replica",
    "load_full_optimizer_state",
    "load_module_state",
    "load_optimizer_state",
    "read_full_optimizer_state",
    "read_optimizer_meta",
    "save_module_state",
    "save_optimizer_state",
    "slice_full",
    "tensor_piece",
    "write_pieces",
]

_SEP = "/"  # FQN/state-key separator: FQNs use dots, state keys never contain a slash
_META = ".meta"


# ---- pieces -----------------------------------------------------------------------------------------


def is_primary_replica(t: DTensor) -> bool:
    """True on the one rank per box that writes it: coordinate 0 on every ``Replicate`` mesh dim."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements) if isinstance(p, Replicate))


Pieces = ckpt.ShardPiece | list[ckpt.ShardPiece]


def tensor_piece(t: torch.Tensor, rank: int) -> Pieces | None:
    """This rank's piece of ``t`` for ``write_shard`` (several boxes for a strided shard, :func:`dtensor_boxes`), or
    None where another rank writes the same boxes."""
    if isinstance(t, DTensor):
        if not is_primary_replica(t):
            return None
        boxes = dtensor_boxes(t)
        local = local_tensor(t).detach()
        if len(boxes) != 1:
            return [ckpt.ShardPiece(local[index].contiguous(), tuple(t.shape), offsets=offsets)
                    for offsets, _, index in boxes]
        offsets, shape, _ = boxes[0]
        if tuple(local.shape) != shape:
            raise RuntimeError(f"local shard of shape {tuple(local.shape)} does not match its placement's box "
                               f"{shape} at {offsets} (placements {t.placements}); this layout is not supported")
        return ckpt.ShardPiece(local, tuple(t.shape), offsets=offsets)
    if rank != 0:
        return None
    return ckpt.ShardPiece(t.detach(), tuple(t.shape), offsets=(0,) * t.dim())


def write_pieces(writer: ckpt.CheckpointWriter, name: str, tensors: Mapping[str, torch.Tensor], rank: int,
                 piece: Callable[[torch.Tensor, int], Pieces | None] = tensor_piece) -> None:
    """Write this rank's pieces of ``tensors`` into the sharded entry ``name`` (every rank calls it)."""
    pieces = {}
    for key, t in tensors.items():
        p = piece(t, rank)
        if p is not None:
            pieces[key] = p
    writer.write_shard(name, pieces)


def _read_local(reader: ckpt.CheckpointReader, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
    """The part of saved tensor ``key`` that ``like`` (a DTensor shard or a plain tensor) holds."""
    if isinstance(like, DTensor):
        boxes = dtensor_boxes(like)
        if len(boxes) == 1:
            return reader.read_box(name, key, boxes[0][0], boxes[0][1])
        out = None
        for offsets, shape, index in boxes:  # a strided shard: its boxes into their places in the local tensor
            box = reader.read_box(name, key, offsets, shape)
            out = box.new_empty(local_tensor(like).shape) if out is None else out
            out[index] = box
        return out
    return reader.read_full(name, key)


def _check_shape(reader: ckpt.CheckpointReader, name: str, key: str, saved: dict, like: torch.Tensor) -> None:
    if key not in saved:
        raise ckpt.CheckpointError(f"{reader.path}: entry {name!r} has no tensor {key!r}; the model changed since "
                                   f"the save (it holds {len(saved)} tensors, e.g. {sorted(saved)[:3]})")
    if tuple(saved[key][0]) != tuple(like.shape):
        raise ckpt.CheckpointError(f"{reader.path}: {name}: {key} was saved with shape {list(saved[key][0])}, the "
                                   f"model has {list(like.shape)}")


# ---- modules ----------------------------------------------------------------------------------------


def save_module_state(writer: ckpt.CheckpointWriter, name: str, module: nn.Module, rank: int, full: bool) -> None:
    """Save a module holding DTensors: its shards (``full=False``) or, gathered, the full tensors on rank 0."""
    state = module.state_dict()
    if not full:
        write_pieces(writer, name, state, rank)
        return
    gathered = {}
    for key, t in state.items():
        value = t.full_tensor() if isinstance(t, DTensor) else t
        if rank == 0:
            gathered[key] = value.detach().cpu()
    if rank == 0:
        writer.write_tensors(name, gathered)


@torch.no_grad()
def load_module_state(reader: ckpt.CheckpointReader, name: str, module: nn.Module) -> None:
    """Copy a saved module (sharded or full, any world size) into a module holding DTensors, in place."""
    saved = reader.sharded_keys(name)
    state = module.state_dict()
    missing = [k for k in state if k not in saved]
    extra = [k for k in saved if k not in state]
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise ckpt.CheckpointError(f"{reader.path}: entry {name!r} does not match {type(module).__name__}: {what} "
                                   f"({len(missing)} missing, {len(extra)} unexpected)")
    for key, t in state.items():
        _check_shape(reader, name, key, saved, t)
        dest = local_tensor(t)
        dest.copy_(_read_local(reader, name, key, t).to(dest.dtype))


# ---- optimizers -------------------------------------------------------------------------------------


def _named_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> tuple[dict, list]:
    """Optimizer state and param groups keyed by parameter FQN (live tensors, no copies)."""
    names = {id(p): n for n, p in module.named_parameters()}
    state, groups = {}, []
    for gi, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise ckpt.CheckpointError(f"optimizer param_groups[{gi}] holds a parameter that is not in "
                                           f"{type(module).__name__}; pass the module the optimizer was built on")
            fqns.append(names[id(p)])
            if p in optimizer.state:
                state[names[id(p)]] = optimizer.state[p]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return state, groups


def _is_sharded_value(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def save_optimizer_state(writer: ckpt.CheckpointWriter, name: str, optimizer: torch.optim.Optimizer,
                         module: nn.Module, rank: int, full: bool) -> None:
    """Save optimizer state whose tensors are DTensors like their parameters (see the module docstring)."""
    state, groups = _named_state(optimizer, module)
    if full:
        gathered: dict[str, dict[str, Any]] = {}
        for fqn, st in state.items():
            gathered[fqn] = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in st.items()}
        if rank == 0:
            writer.write_state(name, {"state": gathered, "param_groups": groups})
        return
    tensors = {f"{fqn}{_SEP}{k}": v for fqn, st in state.items() for k, v in st.items() if _is_sharded_value(v)}
    write_pieces(writer, name, tensors, rank)
    if rank == 0:
        scalars = {fqn: {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in st.items()
                         if not _is_sharded_value(v)} for fqn, st in state.items()}
        keys = {fqn: sorted(k for k, v in st.items() if _is_sharded_value(v)) for fqn, st in state.items()}
        writer.write_state(name + _META, {"param_groups": groups, "scalars": scalars, "tensor_keys": keys})
    else:
        # NOTE: scalars that are DTensors need every rank in the gather above; keep ranks in step.
        for st in state.values():
            for v in st.values():
                if isinstance(v, DTensor) and not _is_sharded_value(v):
                    v.full_tensor()


def read_optimizer_meta(reader: ckpt.CheckpointReader, name: str) -> dict[str, Any] | None:
    """The ``<name>.meta`` entry of a sharded optimizer save, or None for a full one."""
    return reader.read_state(name + _META) if reader.has(name + _META) else None


def read_full_optimizer_state(reader: ckpt.CheckpointReader, name: str) -> dict[str, Any]:
    """Any optimizer save as ``optimizer_state_by_name``'s structure with full tensors (for replicated loads)."""
    meta = read_optimizer_meta(reader, name)
    if meta is None:
        return reader.read_state(name)
    state = {fqn: dict(scalars) for fqn, scalars in meta["scalars"].items()}
    for fqn, keys in meta["tensor_keys"].items():
        for k in keys:
            state.setdefault(fqn, {})[k] = reader.read_full(name, f"{fqn}{_SEP}{k}")
    return {"state": state, "param_groups": meta["param_groups"]}


def _as_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Wrap a loaded local shard as a DTensor laid out like parameter ``like`` (plain stays plain)."""
    if not isinstance(like, DTensor):
        return local.to(like.device)
    return DTensor.from_local(local.to(local_tensor(like).device), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


def load_optimizer_state(reader: ckpt.CheckpointReader, name: str, optimizer: torch.optim.Optimizer,
                         module: nn.Module) -> None:
    """Load a saved optimizer (sharded or full, any world size) into one over DTensor parameters."""
    meta = read_optimizer_meta(reader, name)
    if meta is None:
        load_full_optimizer_state(optimizer, module, reader.read_state(name))
        return
    params = dict(module.named_parameters())
    saved = reader.sharded_keys(name)
    state = {}
    for fqn, keys in meta["tensor_keys"].items():
        like = params.get(fqn)
        if like is None:
            raise ckpt.CheckpointError(f"{reader.path}: optimizer entry {name!r} has state for {fqn!r}, which is not "
                                       f"a parameter of {type(module).__name__}")
        st = dict(meta["scalars"].get(fqn, {}))
        for k in keys:
            key = f"{fqn}{_SEP}{k}"
            _check_shape(reader, name, key, saved, like)
            st[k] = _as_like(_read_local(reader, name, key, like), like)
        state[fqn] = st
    ckpt.load_optimizer_state_by_name(optimizer, module, {"state": state, "param_groups": meta["param_groups"]})


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module, nested: dict[str, Any]) -> None:
    """Load a whole-tensor optimizer state keyed by name (``optimizer_state_by_name``'s structure) into one over
    DTensor parameters: each tensor sliced to this rank's shard."""
    params = dict(module.named_parameters())
    state = {}
    for fqn, st in nested["state"].items():
        like = params.get(fqn)
        state[fqn] = {k: (slice_full(v, like) if like is not None and _is_sharded_value(v) else v)
                      for k, v in st.items()}
    ckpt.load_optimizer_state_by_name(optimizer, module, {"state": state, "param_groups": nested["param_groups"]})


def slice_full(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of a whole tensor ``full``, laid out like ``like`` (a DTensor shard, or plain whole)."""
    if not isinstance(like, DTensor):
        return full.to(like.device)
    return _as_like(local_part(full, like).contiguous(), like)
