"""ZeRO checkpoints in shardkit's one format, through DeepSpeed's fragment APIs (no DeepSpeed pickles).

Layout, for a module entry ``model`` and an optimizer entry ``optimizer``:

* ``model`` (sharded): one key per parameter name (the fp32 master weights) and per persistent
  buffer. Each rank writes the flat fragment of every parameter it owns as a ``ShardPiece`` with
  ``flat_range``: under ZeRO-3 the rank's partition ``[r*p, min((r+1)*p, numel))`` of the flattened
  parameter (DeepSpeed pads the last partition at its end; the padding is not written); under
  ZeRO-1/2 the fragment DeepSpeed's ``_hp_mapping`` says the rank updates. Buffers and parameters
  that no optimizer holds are written whole by rank 0.
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
import torch.distributed as dist
from torch import nn

from shardkit import checkpoint as ckpt

__all__ = ["save_module", "load_module", "save_optimizer", "load_optimizer"]

_META = "{}.meta"
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_factor", "scale_window")


def _partition_rank(param: nn.Parameter) -> int:
    group = getattr(param, "ds_process_group", None)
    return dist.get_rank(group=group) if dist.is_initialized() else 0


def _local_range(param: nn.Parameter) -> tuple[int, int, int]:
    """ZeRO-3: (start, end, partition numel) of this rank's slice of the flattened parameter."""
    size = param.ds_tensor.ds_numel
    start = _partition_rank(param) * size
    return min(start, param.ds_numel), min(start + size, param.ds_numel), size


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def _fragment(param: nn.Parameter, stage: int, key: str | None,
              optimizer: Any = None) -> tuple[torch.Tensor, tuple[int, int]] | None:
    """This rank's fp32 fragment of ``param`` (or of its optimizer state ``key``) and its flat range."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    if stage == 3:
        start, end, _ = _local_range(param)
        local = safe_get_local_fp32_param(param) if key is None else safe_get_local_optimizer_state(param, key)
        if local is None or end <= start:
            return None
        return local.reshape(-1)[: end - start], (start, end)
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    address = mapping.lp_fragment_address
    value = mapping.hp_fragment if key is None else _state_fragment(optimizer, mapping, key)
    return value, (address.start, address.start + address.numel)


def _state_fragment(optimizer: Any, mapping: Any, key: str) -> torch.Tensor:
    """ZeRO-1/2: the view of optimizer state ``key`` over the fragment ``mapping`` describes.

    Taken from the state of the param group's flat fp32 partition, not from DeepSpeed's per-parameter
    link (``mapping.optim_fragment``): DeepSpeed 0.19.8 links every group right after stepping the
    FIRST group, when Adam has not yet created the other groups' state, and never links again, so
    under two or more param groups every parameter outside group 0 has no state there.
    """
    flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
    value = _inner(optimizer).state.get(flat, {}).get(key)
    if not isinstance(value, torch.Tensor) or value.shape != flat.shape:
        raise ckpt.CheckpointError(f"optimizer state {key!r} of param group {mapping.param_group_index} is "
                                   f"missing or not one value per element (the other groups have it); "
                                   "save after the optimizer has stepped every group")
    address = mapping.hp_fragment_address
    return value.narrow(0, address.start, address.numel)


def _piece(tensor: torch.Tensor, shape: tuple[int, ...], flat: tuple[int, int]) -> ckpt.ShardPiece:
    return ckpt.ShardPiece(tensor.detach().reshape(-1).float().cpu().clone(), shape, flat_range=flat)


def _trainable(param: nn.Parameter, stage: int) -> bool:
    """Whether the ZeRO optimizer holds an fp32 master (and states) for ``param``."""
    if stage == 3:
        return param.requires_grad and hasattr(param, "_z3_optimizer")
    return hasattr(param, "_hp_mapping")


# ---- module -------------------------------------------------------------------------------------


def save_module(writer: ckpt.CheckpointWriter, name: str, module: nn.Module, stage: int, rank: int) -> None:
    """Every rank writes its fp32 fragments; rank 0 adds the buffers and the parameters without a master."""
    pieces: dict[str, ckpt.ShardPiece] = {}
    for pname, param in module.named_parameters():
        shape = _shape(param)
        found = _fragment(param, stage, None) if _trainable(param, stage) else None
        if found is not None:
            pieces[pname] = _piece(found[0], shape, found[1])
        elif not _trainable(param, stage) and stage == 3:
            start, end, _ = _local_range(param)
            if end > start:
                pieces[pname] = _piece(param.ds_tensor.reshape(-1)[: end - start], shape, (start, end))
        elif not _trainable(param, stage) and rank == 0:
            pieces[pname] = _piece(param, shape, (0, math.prod(shape)))
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


def load_module(reader: ckpt.CheckpointReader, name: str, module: nn.Module, stage: int, optimizer: Any) -> None:
    """Fill each rank's fp32 fragments and low-precision copies from any shardkit save of the module."""
    from deepspeed.utils import safe_set_local_fp32_param

    params = list(module.named_parameters())
    buffers = _persistent_buffers(module)
    _check_keys(reader, name, {**{n: _shape(p) for n, p in params}, **{n: tuple(b.shape) for n, b in buffers}})
    for pname, param in params:
        if stage == 3:
            start, end, size = _local_range(param)
            local = torch.zeros(size, dtype=torch.float32)
            local[: end - start] = reader.read_flat_range(name, pname, start, end).float()
            if _trainable(param, stage):  # its low-precision partition follows in _refresh_stage3_partitions
                safe_set_local_fp32_param(param, local)
            else:
                param.ds_tensor.data.copy_(local.to(param.ds_tensor.dtype).view_as(param.ds_tensor))
            continue
        full = reader.read_full(name, pname).reshape(-1).float()
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            address = mapping.lp_fragment_address
            mapping.hp_fragment.data.copy_(full.narrow(0, address.start, address.numel))
        with torch.no_grad():
            param.data.copy_(full.view(param.shape).to(param.dtype))
    for bname, buf in buffers:
        buf.data.copy_(reader.read_full(name, bname).to(buf.dtype))
    if stage == 3:
        _refresh_stage3_partitions(optimizer)


def _refresh_stage3_partitions(optimizer: Any) -> None:
    """Copy the fp32 partitions into the low-precision partitions, as DeepSpeed's own step does."""
    # NOTE: private DeepSpeed API (stage3.py, 0.19.8); the fragment setters only write the fp32 copy.
    for group in range(len(getattr(optimizer, "fp16_groups", []))):
        swappable = optimizer._swappable_optimizer_subgroup(group)
        if swappable:
            optimizer._optimizer_states_and_gradient_swap_in(group)
        optimizer._reassign_or_swap_out_partitioned_parameters(group)
        if swappable:
            optimizer._optimizer_states_and_gradient_swap_out(group)


# ---- optimizer ----------------------------------------------------------------------------------


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's ZeRO wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _state_keys(optimizer: Any) -> list[str]:
    """Per-element state keys of the inner optimizer (exp_avg, exp_avg_sq, ...), from its first state."""
    inner = _inner(optimizer)
    for state in inner.state.values():
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() > 1)
    return []


def _step_count(optimizer: Any) -> int:
    for state in _inner(optimizer).state.values():
        step = state.get("step", 0)
        return int(step.item() if isinstance(step, torch.Tensor) else step)
    return 0


def save_optimizer(writer: ckpt.CheckpointWriter, name: str, optimizer: Any, module: nn.Module, stage: int,
                   rank: int) -> None:
    """Every rank writes its optimizer-state fragments; rank 0 writes the step, groups and loss scaler."""
    keys = _state_keys(optimizer)
    pieces: dict[str, ckpt.ShardPiece] = {}
    for pname, param in module.named_parameters():
        if not _trainable(param, stage):
            continue
        for key in keys:
            found = _fragment(param, stage, key, optimizer)
            if found is not None:
                pieces[f"{pname}/{key}"] = _piece(found[0], _shape(param), found[1])
    writer.write_shard(name, pieces)
    if rank == 0:
        groups = _named_groups(optimizer, module, stage)
        step = _step_count(optimizer)
        scaler = getattr(optimizer, "loss_scaler", None)
        scaler_state = {f: getattr(scaler, f) for f in _SCALER_FIELDS if hasattr(scaler, f)}
        # "scalars" and "tensor_keys" are the layout of the FSDP/TP saves (strategies/_sharded_state.py),
        # so that the base hooks of SingleDevice/DDP and FSDP's loader read a ZeRO save as well.
        trainable = [n for g in groups for n in g["params"]]
        meta = {"step": step, "param_groups": groups, "state_keys": keys, "loss_scaler": scaler_state,
                "stage": stage, "scalars": {n: {"step": torch.tensor(float(step))} for n in trainable},
                "tensor_keys": {n: keys for n in trainable}}
        writer.write_state(_META.format(name), meta)


def _named_groups(optimizer: Any, module: nn.Module, stage: int) -> list[dict[str, Any]]:
    """The param groups' hyperparameters with ``params`` as the names of the model parameters in each group."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optimizer.param_groups]
    if stage == 3:  # DeepSpeed splits each group into sub-groups and records which group each came from
        for sub, params in enumerate(optimizer.fp16_groups):
            groups[optimizer.sub_group_to_group_id[sub]]["params"].extend(names[id(p)] for p in params)
    else:
        for group, params in zip(groups, optimizer.bit16_groups):
            group["params"].extend(names[id(p)] for p in params)
    return groups


class _FullOptimizerState:
    """Reads a full by-name optimizer state (saved by DDP/SingleDevice) like a sharded entry."""

    def __init__(self, nested: dict[str, Any]):
        self.state = nested["state"]
        self.meta = {"param_groups": nested["param_groups"], "loss_scaler": {},
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


def load_optimizer(reader: ckpt.CheckpointReader, name: str, optimizer: Any, module: nn.Module, stage: int) -> None:
    """Fill each rank's optimizer-state fragments, then the step count, the groups and the loss scaler."""
    from deepspeed.utils import safe_set_local_optimizer_state

    kind = reader.entries().get(name)
    source = _ShardedOptimizerState(reader, name) if kind == "sharded" else _FullOptimizerState(reader.read_state(name))
    if not _inner(optimizer).state:
        _create_state(optimizer, stage, source.meta.get("state_keys", ["exp_avg", "exp_avg_sq"]))
    keys = _state_keys(optimizer)
    trainable = [(n, p) for n, p in module.named_parameters() if _trainable(p, stage)]
    missing = [f"{n}/{k}" for n, _ in trainable for k in keys if not source.has(n, k)]
    if missing:
        raise ckpt.CheckpointError(f"{reader.path}: optimizer entry {name!r} has no state {missing[0]!r} "
                                   f"({len(missing)} missing); it was saved for another model or optimizer")
    if len(source.meta["param_groups"]) != len(optimizer.param_groups):
        raise ckpt.CheckpointError(f"{reader.path}: {name} has {len(source.meta['param_groups'])} param groups, "
                                   f"this optimizer has {len(optimizer.param_groups)}")
    for pname, param in trainable:
        for key in keys:
            if stage == 3:
                start, end, size = _local_range(param)
                local = torch.zeros(size, dtype=torch.float32)
                local[: end - start] = source.flat(pname, key, start, end).float()
                safe_set_local_optimizer_state(param, local, key)
                continue
            mapping = param._hp_mapping
            if mapping is None:  # stage 1/2: no element of this parameter is in this rank's partition
                continue
            address = mapping.lp_fragment_address
            value = source.flat(pname, key, address.start, address.start + address.numel)
            _state_fragment(optimizer, mapping, key).copy_(value.reshape(-1).float())
    _load_meta(optimizer, source.meta)


def _create_state(optimizer: Any, stage: int, keys: list[str]) -> None:
    """Create the optimizer's per-partition state (zeros, step 0) that a fresh engine lacks.

    Adam creates its state at the first step and DeepSpeed links the per-parameter fragments to it
    then (stage 1/2) or looks it up per step (stage 3); a load before that step would otherwise find
    nothing to fill, and the first resumed step would start from fresh moments.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = _inner(optimizer)
    # DeepSpeedCPUAdam counts steps in a Python int (passed to its C++ kernel); torch's Adam in a 0-d tensor.
    step = 0 if isinstance(inner, DeepSpeedCPUAdam) else None
    flats = optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups
    for group, flat in enumerate(flats):
        if stage == 3 and optimizer._swappable_optimizer_subgroup(group):
            raise ckpt.CheckpointError("loading optimizer state into a ZeRO-3 engine whose optimizer state is "
                                       "swapped to NVMe before its first step is not supported; load with "
                                       "offload_optimizer='cpu' or None")
        inner.state[flat] = {"step": torch.tensor(0.0) if step is None else step,
                             **{k: torch.zeros_like(flat) for k in keys}}
    if stage != 3:
        # NOTE: private DeepSpeed API (stage_1_and_2.py, 0.19.8): points each parameter's fragment
        # mapping at the state just created, as its first step would.
        optimizer._lazy_init_hp_params_optimizer_state()


def _load_meta(optimizer: Any, meta: dict[str, Any]) -> None:
    for state in _inner(optimizer).state.values():
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
