"""Where DeepSpeed keeps each rank's share of the model state, per ZeRO stage.

The checkpoint code (``checkpoint.py``) and the memory count (``memory.py``) are written once against
:class:`ZeROLayout`; the strategy hands them its stage's layout:

* :class:`FlatPartitionLayout` (ZeRO-1/2): every rank holds the parameters whole; the fp32 master weights
  and the optimizer states are one flat partition per param group, and DeepSpeed's ``_hp_mapping`` on
  each parameter says which fragment of it this rank's partition covers.
* :class:`ParameterPartitionLayout` (ZeRO-3): every parameter is itself partitioned; rank r holds the
  slice ``[r*p, min((r+1)*p, numel))`` of the flattened parameter (``ds_tensor``, padded at its end), and
  the fp32 master and states are reached per parameter through DeepSpeed's fragment APIs.

Only DeepSpeed 0.19.8's structures are read here; the private ones are marked NOTE where used.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit import checkpoint as ckpt

__all__ = ["ZeROLayout", "FlatPartitionLayout", "ParameterPartitionLayout", "inner_optimizer"]

Range = tuple[int, int]
Fragment = tuple[torch.Tensor, Range]  # a rank's flat slice of a tensor and where it sits in the whole


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's ZeRO wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def param_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's real shape (zero.Init leaves ``param.shape`` empty; ``ds_shape`` is the real one)."""
    return tuple(getattr(param, "ds_shape", param.shape))


class ZeROLayout:
    """How one ZeRO stage lays out parameters, fp32 master weights and optimizer states across ranks.

    Args:
        stage: the ZeRO stage number, recorded in checkpoint metadata.
    """

    def __init__(self, stage: int):
        self.stage = stage

    def trainable(self, param: nn.Parameter) -> bool:
        """Whether the ZeRO optimizer holds an fp32 master (and states) for ``param``."""
        raise NotImplementedError

    def fragment(self, param: nn.Parameter, key: str | None, optimizer: Any = None) -> Fragment | None:
        """This rank's fp32 fragment of ``param`` (or of its optimizer state ``key``) and its flat range."""
        raise NotImplementedError

    def frozen_piece(self, param: nn.Parameter, rank: int) -> Fragment | None:
        """What this rank writes of a parameter no optimizer holds, and its flat range (None: nothing)."""
        raise NotImplementedError

    def load_parameter(self, reader: ckpt.CheckpointReader, name: str, pname: str, param: nn.Parameter) -> None:
        """Fill this rank's copies of ``param`` (fp32 master fragment, low-precision values) from entry ``name``."""
        raise NotImplementedError

    def after_module_load(self, optimizer: Any) -> None:
        """Bring what DeepSpeed derives from the fp32 masters up to date after a module load."""

    def masters_to_model(self, optimizer: Any) -> None:
        """Copy the fp32 masters, changed outside DeepSpeed's step (a schedule-free swap), into the model."""
        raise NotImplementedError

    def masters_in_groups(self, optimizer: Any) -> contextlib.AbstractContextManager[None]:
        """Within it, the inner optimizer's param groups hold this rank's fp32 masters (ZeRO-1/2 always do)."""
        return contextlib.nullcontext()

    def load_state(self, source: Any, pname: str, param: nn.Parameter, key: str, optimizer: Any) -> None:
        """Fill this rank's fragment of optimizer state ``key`` of ``param`` from ``source.flat(...)``."""
        raise NotImplementedError

    def group_params(self, optimizer: Any) -> list[tuple[int, list[nn.Parameter]]]:
        """``(param group index, parameters)`` for each of the optimizer's flat groups."""
        raise NotImplementedError

    def master_partitions(self, optimizer: Any) -> list[torch.Tensor]:
        """This rank's flat fp32 master partitions, the keys of the inner optimizer's state."""
        raise NotImplementedError

    def check_state_creatable(self, optimizer: Any, index: int) -> None:
        """Raise where fresh state cannot be created for master partition ``index`` before the first step."""

    def link_state(self, optimizer: Any) -> None:
        """Point the per-parameter views at state just created, as DeepSpeed's first step would."""

    def held_parameters(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The low-precision parameter tensors this rank holds right now (for the memory count)."""
        raise NotImplementedError


class FlatPartitionLayout(ZeROLayout):
    """ZeRO-1/2: whole parameters on every rank; masters and states in one flat partition per group."""

    def trainable(self, param: nn.Parameter) -> bool:
        return hasattr(param, "_hp_mapping")

    def fragment(self, param: nn.Parameter, key: str | None, optimizer: Any = None) -> Fragment | None:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        address = mapping.lp_fragment_address
        value = mapping.hp_fragment if key is None else _state_fragment(optimizer, mapping, key)
        return value, (address.start, address.start + address.numel)

    def frozen_piece(self, param: nn.Parameter, rank: int) -> Fragment | None:
        return (param, (0, math.prod(param_shape(param)))) if rank == 0 else None  # whole on every rank

    def load_parameter(self, reader: ckpt.CheckpointReader, name: str, pname: str, param: nn.Parameter) -> None:
        full = reader.read_full(name, pname).reshape(-1).float()
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            address = mapping.lp_fragment_address
            mapping.hp_fragment.data.copy_(full.narrow(0, address.start, address.numel))
        with torch.no_grad():
            param.data.copy_(full.view(param.shape).to(param.dtype))

    def load_state(self, source: Any, pname: str, param: nn.Parameter, key: str, optimizer: Any) -> None:
        mapping = param._hp_mapping
        if mapping is None:  # no element of this parameter is in this rank's partition
            return
        address = mapping.lp_fragment_address
        value = source.flat(pname, key, address.start, address.start + address.numel)
        _state_fragment(optimizer, mapping, key).copy_(value.reshape(-1).float())

    def group_params(self, optimizer: Any) -> list[tuple[int, list[nn.Parameter]]]:
        return list(enumerate(optimizer.bit16_groups))

    def master_partitions(self, optimizer: Any) -> list[torch.Tensor]:
        return list(optimizer.single_partition_of_fp32_groups)

    def link_state(self, optimizer: Any) -> None:
        # NOTE: private DeepSpeed API (stage_1_and_2.py, 0.19.8): points each parameter's fragment
        # mapping at the state just created, as its first step would.
        optimizer._lazy_init_hp_params_optimizer_state()

    def held_parameters(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        return [p.data for p in params]


    def masters_to_model(self, optimizer: Any) -> None:
        optimizer.update_lp_params()  # into the bit16 partitions, then all-gathered


def _state_fragment(optimizer: Any, mapping: Any, key: str) -> torch.Tensor:
    """ZeRO-1/2: the view of optimizer state ``key`` over the fragment ``mapping`` describes.

    Taken from the state of the param group's flat fp32 partition, not from DeepSpeed's per-parameter
    link (``mapping.optim_fragment``): DeepSpeed 0.19.8 links every group right after stepping the
    FIRST group, when Adam has not yet created the other groups' state, and never links again, so
    under two or more param groups every parameter outside group 0 has no state there.
    """
    flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
    value = inner_optimizer(optimizer).state.get(flat, {}).get(key)
    if not isinstance(value, torch.Tensor) or value.shape != flat.shape:
        raise ckpt.CheckpointError(f"optimizer state {key!r} of param group {mapping.param_group_index} is "
                                   f"missing or not one value per element (the other groups have it); "
                                   "save after the optimizer has stepped every group")
    address = mapping.hp_fragment_address
    return value.narrow(0, address.start, address.numel)



class ParameterPartitionLayout(ZeROLayout):
    """ZeRO-3: each parameter partitioned across ranks; masters and states reached per parameter."""

    def __init__(self, stage: int = 3):
        super().__init__(stage)

    def trainable(self, param: nn.Parameter) -> bool:
        return param.requires_grad and hasattr(param, "_z3_optimizer")

    def fragment(self, param: nn.Parameter, key: str | None, optimizer: Any = None) -> Fragment | None:
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        start, end, _ = _local_range(param)
        local = safe_get_local_fp32_param(param) if key is None else safe_get_local_optimizer_state(param, key)
        if local is None or end <= start:
            return None
        return local.reshape(-1)[: end - start], (start, end)

    def frozen_piece(self, param: nn.Parameter, rank: int) -> Fragment | None:
        start, end, _ = _local_range(param)  # partitioned like the rest: every rank writes its slice
        return (param.ds_tensor.reshape(-1)[: end - start], (start, end)) if end > start else None

    def load_parameter(self, reader: ckpt.CheckpointReader, name: str, pname: str, param: nn.Parameter) -> None:
        from deepspeed.utils import safe_set_local_fp32_param

        start, end, size = _local_range(param)
        local = torch.zeros(size, dtype=torch.float32)
        local[: end - start] = reader.read_flat_range(name, pname, start, end).float()
        if self.trainable(param):  # its low-precision partition follows in after_module_load
            safe_set_local_fp32_param(param, local)
        else:
            param.ds_tensor.data.copy_(local.to(param.ds_tensor.dtype).view_as(param.ds_tensor))

    def after_module_load(self, optimizer: Any) -> None:
        """Copy the fp32 partitions into the low-precision partitions, as DeepSpeed's own step does."""
        # NOTE: private DeepSpeed API (stage3.py, 0.19.8); the fragment setters only write the fp32 copy.
        for group in range(len(getattr(optimizer, "fp16_groups", []))):
            swappable = optimizer._swappable_optimizer_subgroup(group)
            if swappable:
                optimizer._optimizer_states_and_gradient_swap_in(group)
            optimizer._reassign_or_swap_out_partitioned_parameters(group)
            if swappable:
                optimizer._optimizer_states_and_gradient_swap_out(group)

    def masters_to_model(self, optimizer: Any) -> None:
        self.after_module_load(optimizer)  # each rank's partition of every parameter, gathered at the next forward
        # The small "persistent" parameters are kept whole: released and gathered again from their partitions.
        # NOTE: private DeepSpeed API (stage3.py, 0.19.8).
        persistent = getattr(optimizer, "persistent_parameters", [])
        if persistent:
            persistent[0].partition(persistent)
            persistent[0].all_gather(persistent)

    @contextlib.contextmanager
    def masters_in_groups(self, optimizer: Any) -> Iterator[None]:
        # ZeRO-3 empties the inner optimizer's param groups outside its step (it puts one fp32 sub-group in,
        # steps, and takes it out again): put every sub-group of each group in for the duration.
        from shardkit.optim.named import OptimizerUnsupportedError

        inner = inner_optimizer(optimizer)
        owners = optimizer.sub_group_to_group_id
        per_group = [[flat for sub, flat in enumerate(optimizer.fp32_partitioned_groups_flat) if owners[sub] == g]
                     for g in range(len(inner.param_groups))]
        if any(len(found) > 1 for found in per_group):
            # Its step runs once per sub-group, and schedule-free counts steps (k) per param group.
            raise OptimizerUnsupportedError("schedule-free under ZeRO-3 needs each param group in one DeepSpeed "
                                            "sub-group (it counts steps per group, and ZeRO-3 steps each sub-group "
                                            "separately): raise zero_optimization.sub_group_size above the largest "
                                            "group's size (ZeRO3(extra={'zero_optimization': {'sub_group_size': "
                                            "N}}))")
        saved = [group["params"] for group in inner.param_groups]
        try:
            for group, found in zip(inner.param_groups, per_group):
                group["params"] = found
            yield
        finally:
            for group, params in zip(inner.param_groups, saved):
                group["params"] = params

    def load_state(self, source: Any, pname: str, param: nn.Parameter, key: str, optimizer: Any) -> None:
        from deepspeed.utils import safe_set_local_optimizer_state

        start, end, size = _local_range(param)
        local = torch.zeros(size, dtype=torch.float32)
        local[: end - start] = source.flat(pname, key, start, end).float()
        safe_set_local_optimizer_state(param, local, key)

    def group_params(self, optimizer: Any) -> list[tuple[int, list[nn.Parameter]]]:
        # DeepSpeed splits each group into sub-groups and records which group each came from.
        return [(optimizer.sub_group_to_group_id[sub], params) for sub, params in enumerate(optimizer.fp16_groups)]

    def master_partitions(self, optimizer: Any) -> list[torch.Tensor]:
        return list(optimizer.fp32_partitioned_groups_flat)

    def check_state_creatable(self, optimizer: Any, index: int) -> None:
        if optimizer._swappable_optimizer_subgroup(index):
            raise ckpt.CheckpointError("loading optimizer state into a ZeRO-3 engine whose optimizer state is "
                                       "swapped to NVMe before its first step is not supported; load with "
                                       "offload_optimizer='cpu' or None")

    def held_parameters(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        # The rank's partitions, plus the small parameters kept whole (ds_persist) and any still gathered.
        return [p.ds_tensor for p in params if hasattr(p, "ds_tensor")] + [p.data for p in params if p.data.numel()]


def _partition_rank(param: nn.Parameter) -> int:
    group = getattr(param, "ds_process_group", None)
    return dist.get_rank(group=group) if dist.is_initialized() else 0


def _local_range(param: nn.Parameter) -> tuple[int, int, int]:
    """(start, end, partition numel) of this rank's slice of the flattened parameter."""
    size = param.ds_tensor.ds_numel
    start = _partition_rank(param) * size
    return min(start, param.ds_numel), min(start + size, param.ds_numel), size
