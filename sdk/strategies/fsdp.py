"""Fully sharded data parallel on torch FSDP2 (``fully_shard``): parameters, gradients and optimizer
state are sharded over a device mesh and gathered layer by layer for compute."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from typing_extensions import override

from shardkit.strategies import _dtensor, _sharded_init
from shardkit.strategies import activation_checkpointing as checkpointing
from shardkit.strategies.facts import MemoryJob, StateBytes, StrategyFamily
from shardkit.strategies.parallel import MeshStrategy
from shardkit.strategies.parallel_dims import ParallelDims
from shardkit.strategies.quant_storage import check_quant_storage
from shardkit.utils.suggest import did_you_mean

__all__ = ["FSDP", "FSDPSettings", "MESH_DIM_NAMES"]

SHARDING_MODES = ("full", "grad_op", "hybrid", "none")
STATE_DICT_TYPES = ("sharded", "full")
# ParallelDims' data-parallel dimensions under the names FSDP's mesh has always had (users read mesh["shard"]).
MESH_DIM_NAMES = {"dp_replicate": "replicate", "dp_shard": "shard"}
ModuleClasses = type | str | tuple[type | str, ...]  # module classes or class names (as configs spell them)


def _choice(value: str, options: tuple[str, ...], field: str) -> None:
    if value not in options:
        raise ValueError(f"FSDP {field}={value!r} is not one of {options}{did_you_mean(str(value), options)}")


_is_classes = checkpointing.is_module_classes


def _resolve_classes(value: Any, module: nn.Module, field: str) -> tuple[type, ...]:
    return checkpointing.resolve_module_classes(value, module, f"FSDP {field}")


@dataclass(frozen=True)
class FSDPSettings:
    """Settings of FSDP that users tune.

    Args:
        sharding: "full" (params, grads and optimizer state sharded; params freed after each layer's
            forward, ZeRO-3), "grad_op" (kept gathered from forward to backward, ZeRO-2-like),
            "hybrid" (sharded within groups of ``hybrid_shard_size`` ranks, replicated across them),
            "none" (replicated, like DDP, on the same engine).
        auto_wrap: what becomes its own FSDP unit: a module class or class name (as configs spell it),
            a tuple of them, or a minimum parameter count; None detects repeated blocks (the classes
            held in any nn.ModuleList); False shards only the root.
        cpu_offload: keep sharded parameters, gradients and the optimizer step on the CPU.
        activation_checkpointing: recompute the forward of these block classes in backward
            (True: the auto-wrap block classes), or :class:`shardkit.strategies.ActivationCheckpointing`
            for ``use_reentrant`` and the rest; the same mechanism as ``Runner(activation_checkpointing=...)``.
        reshard_after_forward: override the sharding mode's choice of freeing params after forward.
        sync_module_states: start every rank from rank 0's weights.
        hybrid_shard_size: ranks per shard group in "hybrid" (default: processes per node).
        state_dict_type: "sharded" (each rank writes its shards) or "full" (gathered to rank 0).
        cpu_ram_efficient_loading: Accelerate's option of that name: only rank 0 keeps the model's real weights;
            every other rank builds it on the meta device (``init_module()``; transformers' ``from_pretrained``
            is told through Accelerate's environment variables) or drops its copy in ``setup``, and after
            sharding each rank receives its shards from rank 0, one tensor at a time. Needs
            ``sync_module_states``.
    """

    sharding: str = "full"
    auto_wrap: ModuleClasses | int | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool | ModuleClasses | checkpointing.ActivationCheckpointing = False
    reshard_after_forward: bool | None = None
    sync_module_states: bool = True
    hybrid_shard_size: int | None = None
    state_dict_type: str = "sharded"
    cpu_ram_efficient_loading: bool = False

    def __post_init__(self) -> None:
        _choice(self.sharding, SHARDING_MODES, "sharding")
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise ValueError("FSDP cpu_ram_efficient_loading=True needs sync_module_states=True: only rank 0 holds "
                             "the weights and the other ranks receive them (as Accelerate refuses this combination "
                             "too); set sync_module_states=True or drop cpu_ram_efficient_loading")
        _choice(self.state_dict_type, STATE_DICT_TYPES, "state_dict_type")
        if self.hybrid_shard_size is not None:
            if self.sharding != "hybrid":
                raise ValueError(f"FSDP hybrid_shard_size={self.hybrid_shard_size} only applies to sharding='hybrid', "
                                 f"not {self.sharding!r}")
            size = self.hybrid_shard_size
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"FSDP hybrid_shard_size={size!r} must be an int >= 1 (ranks per shard group)")
        if self.sharding == "grad_op" and self.reshard_after_forward:
            raise ValueError("FSDP sharding='grad_op' keeps parameters gathered after forward; "
                             "reshard_after_forward=True contradicts it (use sharding='full')")
        if self.auto_wrap is True or not (
            self.auto_wrap is None or self.auto_wrap is False or _is_classes(self.auto_wrap)
            or isinstance(self.auto_wrap, int)
        ):
            raise ValueError(f"FSDP auto_wrap={self.auto_wrap!r} must be a module class or class name, a tuple of "
                             "them, a minimum parameter count, False (shard only the root) or None (detect blocks)")
        if isinstance(self.auto_wrap, int) and not isinstance(self.auto_wrap, bool) and self.auto_wrap < 1:
            raise ValueError(f"FSDP auto_wrap={self.auto_wrap} parameters must be >= 1")
        ac = self.activation_checkpointing
        if not isinstance(ac, (bool, checkpointing.ActivationCheckpointing)) and not _is_classes(ac):
            raise ValueError(f"FSDP activation_checkpointing={ac!r} must be a bool, a module class or a tuple of them, "
                             "or ActivationCheckpointing(...)")

    def parallel_dims(self, world_size: int, local_world_size: int) -> ParallelDims:
        """The mesh's sizes: "full"/"grad_op" shard over every rank (dp_shard = world), "hybrid" within groups of
        ``hybrid_shard_size`` (default: ``local_world_size``) replicated across them, "none" replicates on every rank.

        Raises:
            ValueError: (from ParallelDims) ``hybrid_shard_size`` does not divide ``world_size``.
        """
        size = {"full": world_size, "grad_op": world_size, "none": 1}.get(self.sharding)
        if size is None:
            size = self.hybrid_shard_size or local_world_size
        return ParallelDims.data_parallel(world_size, size, owner=f"FSDP sharding={self.sharding!r}",
                                          name="hybrid_shard_size" if self.sharding == "hybrid" else "dp_shard")

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The FSDP mesh's dimensions: ("shard",), or ("replicate", "shard") for "hybrid" and "none"."""
        return ("shard",) if self.sharding in ("full", "grad_op") else ("replicate", "shard")

    def mesh_shape(self, world_size: int, local_world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh: 1-D ("shard",) or 2-D ("replicate", "shard") for "hybrid" and "none"."""
        dims = self.parallel_dims(world_size, local_world_size)
        sizes = {"replicate": dims.dp_replicate, "shard": dims.dp_shard}
        return tuple(sizes[n] for n in self.mesh_dim_names), self.mesh_dim_names

    @property
    def reshard(self) -> bool:
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.sharding in ("full", "hybrid")


class FSDP(MeshStrategy):
    """torch FSDP2 over a device mesh; NCCL on GPUs and gloo on CPUs.

    Parameters are gathered for compute in the precision's ``compute_dtype`` (master weights stay in
    ``param_dtype``) and gradients are reduced in its ``comm_dtype``. Build the optimizer over
    ``model.parameters()`` before or after ``runner.setup()``; it is rebound to the sharded ones.

    Args:
        sharding, auto_wrap, cpu_offload, activation_checkpointing, reshard_after_forward,
        sync_module_states, hybrid_shard_size, state_dict_type, cpu_ram_efficient_loading: see
        :class:`FSDPSettings`.
        timeout: seconds a collective may wait before the job fails (default: SHARDKIT_COLLECTIVE_TIMEOUT
            or 1800).
    """

    family = StrategyFamily.FSDP

    def __init__(
        self, sharding: str = "full", auto_wrap: ModuleClasses | int | None = None, cpu_offload: bool = False,
        activation_checkpointing: bool | ModuleClasses = False, reshard_after_forward: bool | None = None,
        sync_module_states: bool = True, hybrid_shard_size: int | None = None, state_dict_type: str = "sharded",
        timeout: float | None = None, cpu_ram_efficient_loading: bool = False,
    ):
        super().__init__(timeout)
        self.settings = FSDPSettings(sharding, auto_wrap, cpu_offload, activation_checkpointing,
                                     reshard_after_forward, sync_module_states, hybrid_shard_size, state_dict_type,
                                     cpu_ram_efficient_loading)
        self._recorders: list[_sharded_init.MetaInitRecorder] = []
        self.dims: ParallelDims | None = None  # set with the mesh in setup_environment
        self.world_mesh: Any = None

    @override
    def model_state_memory(self, job: MemoryJob) -> StateBytes:
        """full: everything over every rank, the largest layer gathered; grad_op: parameters gathered whole from
        forward to backward; hybrid: sharded within a node, replicated across nodes; none: replicated;
        cpu_offload: the sharded states in host memory, only the layer being computed on the device."""
        psi, p, g = job.params, job.param_bytes, job.grad_bytes
        sharding = self.settings.sharding
        if self.settings.cpu_offload:
            return StateBytes(0, 0, 0, working=job.largest_layer * p,
                              host=job.share(psi * (p + g + job.optimizer_bytes)))
        if sharding == "grad_op":
            shard = job.share(psi * p)
            return StateBytes(shard, job.share(psi * g), job.share(psi * job.optimizer_bytes), working=psi * p - shard)
        if sharding == "hybrid":
            return StateBytes.sharded(job, self.settings.hybrid_shard_size or job.ranks_per_node)
        if sharding == "none":
            return StateBytes.replicated(job)
        return StateBytes.sharded(job)

    # ---- environment -------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.dims = self.settings.parallel_dims(self.world_size, self._local_world_size)
        # The one mesh every strategy builds (ParallelDims), under FSDP's public dimension names; FSDP2 shards over
        # its ("shard",) or ("replicate", "shard") part.
        self.world_mesh = self.dims.build(self.device_type, names=MESH_DIM_NAMES)
        names = self.settings.mesh_dim_names
        self.mesh = self.world_mesh[names[0]] if len(names) == 1 else self.world_mesh[names]
        if self.settings.cpu_ram_efficient_loading:
            # What `accelerate launch` exports for this option: transformers' from_pretrained then leaves the weights
            # it does not load on the meta device and skips their random init on every local rank but 0.
            os.environ["ACCELERATE_USE_FSDP"] = "true"
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"

    # ---- modules -----------------------------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Context to build a model in, in the parameter dtype.

        ``empty_init=None`` (the default): parameters go on the meta device and each one's init is
        recorded with the RNG state it drew from; ``setup`` rebuilds them one at a time and keeps the
        local shards, so the weights equal, bitwise, an unsharded build's from the same seed (rank 0's
        RNG stream), and no rank ever holds more than one whole parameter. Between the block and ``setup``
        the parameters are on the meta device: ``model.load_state_dict(...)`` there is kept (it goes into the
        records), any other write is lost; write weights inside the block or after ``setup``.
        ``empty_init=True``: on the meta device (on every rank but 0 when ``sync_module_states``, so rank
        0's weights, pretrained ones loaded into it included, are what every shard starts from),
        materialised shard by shard in setup. ``empty_init=False``: the whole model on every rank. With
        ``cpu_ram_efficient_loading`` the default is ``empty_init=True``: rank 0 alone builds (or loads) the weights.
        """
        if empty_init is None and self.settings.cpu_ram_efficient_loading:
            empty_init = True
        stack = contextlib.ExitStack()
        stack.enter_context(super().module_init_context(empty_init))
        if empty_init is None:
            stack.enter_context(_sharded_init.rank0_rng(self.root_device))
            recorder = _sharded_init.MetaInitRecorder()
            self._recorders.append(recorder)
            stack.enter_context(recorder)
        elif empty_init and not (self.settings.sync_module_states and self.is_global_zero):
            stack.enter_context(_dtensor.meta_parameters())
        return stack

    @override
    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None):
        if self.is_global_zero:  # the settings in effect, once per setup, on the main process: the log says what ran
            logging.getLogger("shardkit.strategies.fsdp").info("shardkit: FSDP2 settings: %s, precision %r",
                                                               self.settings, self.precision)
        module, optimizer, scheduler = super().setup(module, optimizer, scheduler)
        # NOTE: transformers' generate syncs the ranks (synced_gpus) only for a module it knows FSDP manages: the
        # flag its own FSDP2 wrapper sets. Without it, ranks asking for different numbers of tokens hang.
        module._is_fsdp_managed_module = True
        return module, optimizer, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        check_quant_storage(module, _dtensor.mp_policy(self.precision).param_dtype)  # QLoRA: packed 4-bit weights
        records = self._init_records(module)
        if records:
            return self._setup_recorded(module, records)
        sync = self.settings.sync_module_states and self.world_size > 1
        if sync and self.settings.cpu_ram_efficient_loading and not self.is_global_zero:
            # Rank 0's weights are what every shard starts from: free this copy. NOTE: parameter subclasses (QLoRA's
            # packed 4-bit weights and their quant state) cannot be rebuilt from the meta device; they are sent whole.
            if all(type(p) is nn.Parameter for p in module.parameters()):
                _dtensor.parameters_to_meta(module)
        meta = self._any_rank(_dtensor.has_meta_parameters(module))
        if sync and not meta:
            _dtensor.broadcast_from_rank0(module)
        rank0_state = None
        if meta and sync and self._any_rank(self.is_global_zero and _dtensor.has_meta_parameters(module)):
            # Raised on every rank (the flag is reduced), so that none waits for rank 0's broadcast.
            raise ValueError("FSDP sync_module_states: rank 0's model has parameters on the meta device, so there are "
                             "no weights to send the other ranks; build or load the model with real weights on rank 0 "
                             "(runner.init_module(empty_init=True) does that)")
        if meta and sync and self.is_global_zero:
            rank0_state = {k: v.detach() for k, v in module.state_dict().items()}
        self._shard(module)
        if meta:
            if _dtensor.has_meta_parameters(module):
                _dtensor.materialize(module, self.root_device if not self.settings.cpu_offload else torch.device("cpu"))
                if not sync:
                    _dtensor.initialize_parameters(module)
            if sync:
                _scatter_from_rank0(module, rank0_state)
        return module

    def _init_records(self, module: nn.Module) -> dict[str, _sharded_init.ParamRecord]:
        """Parameter name -> its init record, for a module built under ``init_module()``."""
        records, used = {}, set()
        for name, p in module.named_parameters():
            for i, recorder in enumerate(self._recorders):
                if p in recorder.records:
                    records[name] = recorder.records[p]
                    used.add(i)
        # A record is used once; the recorder (and the meta parameters it keys on) is dropped with it.
        self._recorders = [r for i, r in enumerate(self._recorders) if i not in used]
        return records

    def _setup_recorded(self, module: nn.Module, records: dict[str, _sharded_init.ParamRecord]) -> nn.Module:
        missing = [n for n, p in module.named_parameters() if p.is_meta and n not in records]
        if missing:
            raise ValueError(f"FSDP: parameters {missing[:5]} are on the meta device but were not built under "
                             "runner.init_module(); build the whole model inside it")
        self._shard(module)
        device = self.root_device if not self.settings.cpu_offload else torch.device("cpu")
        _dtensor.materialize(module, device)
        _sharded_init.replay_into(module, records, device)
        return module

    def _any_rank(self, flag: bool) -> bool:
        return bool(_dtensor.reduce_max(torch.tensor(float(flag))).item())

    def _shard(self, module: nn.Module) -> None:
        """Activation checkpointing on the chosen blocks, then fully_shard each unit bottom-up and the root."""
        blocks = self._block_classes(module)
        checkpointing.apply_activation_checkpointing(
            module, checkpointing.resolve_activation_checkpointing(self.settings.activation_checkpointing),
            default_blocks=blocks or None, owner="FSDP activation_checkpointing")
        offload = OffloadPolicy()
        if self.settings.cpu_offload:
            # NOTE: pinned memory needs an accelerator; on a CPU-only machine pinning crashes.
            offload = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        _dtensor.shard_bottom_up(module, self._wrap_targets(module, blocks), mesh=self.mesh,
                              reshard_after_forward=self.settings.reshard, mp_policy=_dtensor.mp_policy(self.precision),
                              offload_policy=offload)

    def _block_classes(self, module: nn.Module) -> tuple[type, ...]:
        wrap = self.settings.auto_wrap
        if wrap is False:
            return ()
        if _is_classes(wrap):
            return _resolve_classes(wrap, module, "auto_wrap")
        return _dtensor.repeated_blocks(module)

    def _wrap_targets(self, module: nn.Module, blocks: tuple[type, ...]) -> list[nn.Module]:
        """Submodules to shard as their own units, children before parents (FSDP2 needs bottom-up)."""
        if isinstance(self.settings.auto_wrap, int) and not isinstance(self.settings.auto_wrap, bool):
            return _size_targets(module, self.settings.auto_wrap)
        return _dtensor.blocks_bottom_up(module, blocks)

    # ---- checkpoints -------------------------------------------------------------------------------

    @override
    def checkpoint_info(self) -> dict[str, Any]:
        info = super().checkpoint_info()
        info.update(sharding=self.settings.sharding, state_dict_type=self.settings.state_dict_type,
                    mesh=list(self.mesh.shape) if self.mesh is not None else None)
        return info

    def __repr__(self) -> str:
        return f"FSDP(sharding={self.settings.sharding!r}, device={self._device})"


def _size_targets(module: nn.Module, min_params: int) -> list[nn.Module]:
    """Bottom-up: a submodule becomes a unit once the parameters not already in a unit below it reach ``min_params``."""
    targets: list[nn.Module] = []
    # A tied parameter (Llama's embedding and lm_head) must stay in one unit: leave its holders to the root.
    holders: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    tied = {pid for pid, n in holders.items() if n > 1}

    def visit(m: nn.Module) -> int:
        own = list(m.parameters(recurse=False))
        count = sum(visit(c) for c in m.children()) + sum(p.numel() for p in own)
        if any(id(p) in tied for p in own):
            return count
        if m is not module and count >= min_params:
            targets.append(m)
            return 0
        return count

    visit(module)
    return targets


@torch.no_grad()
def _scatter_from_rank0(module: nn.Module, rank0_state: dict[str, torch.Tensor] | None) -> None:
    """Fill every rank's shards from rank 0's full tensors, one tensor at a time (so no rank but 0 ever
    holds more than one full tensor), then broadcast the buffers."""
    for key, t in module.state_dict().items():
        if not isinstance(t, DTensor):
            continue
        full = rank0_state[key] if rank0_state is not None else torch.empty(t.shape, dtype=t.dtype)
        full = full.to(device=_dtensor.local_tensor(t).device, dtype=t.dtype).contiguous()
        dist.broadcast(full, src=0)
        _dtensor.local_tensor(t).copy_(_dtensor.local_part(full, t))
    for b in module.buffers():
        dist.broadcast(b.data, src=0)
