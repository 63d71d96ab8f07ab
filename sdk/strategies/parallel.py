"""Base of the strategies that run one process per device in a process group: the collectives, the
process group's lifetime (with the gloo teardown workaround), and the DTensor mesh base of FSDP and TP."""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from shardkit import checkpoint as ckpt
from shardkit.distributed.process_group import destroy_distributed, init_distributed
from shardkit.strategies import _dtensor, _sharded_state
from shardkit.strategies.base import Strategy, param_list, replicated_gathered
from shardkit.strategies.facts import StrategyFamily

__all__ = ["ProcessGroupStrategy", "MeshStrategy"]


class ProcessGroupStrategy(Strategy):
    """One process per device, joined in a process group: NCCL on GPUs, gloo on CPUs.

    Args:
        timeout: seconds a collective may wait before the job fails (default: SHARDKIT_COLLECTIVE_TIMEOUT
            or 1800), so that a dead rank ends the job instead of hanging it.
    """

    family = StrategyFamily.DATA_PARALLEL
    # A device mesh and DeepSpeed's engine need a process group even for one process: a process that no launcher
    # started (a plain ``python train.py``) then gets a private one. DDP runs unwrapped without one.
    needs_group: bool = True

    def __init__(self, timeout: float | None = None):
        super().__init__()
        self.timeout = timeout
        self._device: torch.device | None = None
        self._local_rank = 0
        self._local_world_size = 1
        # NOTE: the tensors of our last few collectives stay referenced here until teardown. gloo's
        # worker thread frees finished work; if that drops the last reference to a tensor Python
        # created, it needs the GIL, and a process group being destroyed (by DDP's reducer, holding
        # the GIL) joins that thread: a deadlock at exit, seen here. Work older than the ring is long done.
        self._held: collections.deque = collections.deque(maxlen=8)

    @property
    @override
    def root_device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError(f"{type(self).__name__}'s device is known after setup_environment(); "
                               "create the Runner first")
        return self._device

    @property
    @override
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    @override
    def local_rank(self) -> int:
        return self._local_rank

    @property
    @override
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @override
    def setup_environment(self) -> None:
        env = init_distributed(self.device_type, timeout=self.timeout, private_group=self.needs_group)
        self._local_rank, self._local_world_size = env.local_rank, env.local_world_size
        self._device = torch.device("cuda", env.local_rank) if self.device_type == "cuda" else torch.device("cpu")
        super().setup_environment()

    @override
    def teardown(self) -> None:
        destroy_distributed()  # drains the group's workers (see there) while we still hold the tensors
        self._held.clear()  # freed here, by this thread, with the GIL: see __init__

    @override
    def configure_activation_checkpointing(self, settings: Any) -> None:
        """A DeepSpeed config's section also configures ``deepspeed.checkpointing``, under every strategy with a
        process group (DeepSpeed's comm layer wraps it), for a model that calls it in its own forward."""
        from shardkit.strategies.zero.activation import configure_deepspeed_checkpointing

        configure_deepspeed_checkpointing(settings)

    @override
    def gathered_parameters(self, params: Any, modifier_rank: int | None = None,
                            module: nn.Module | None = None) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Every rank holds whole parameters: yields them; with ``modifier_rank=r``, rank r's values are
        broadcast on exit so the replicas stay equal."""
        return replicated_gathered(param_list(params), modifier_rank)

    # ---- collectives (a world of one, e.g. one process without a group, answers locally) -----------

    def _alone(self) -> bool:
        return not dist.is_initialized() or self.world_size == 1

    @override
    def barrier(self, name: str | None = None) -> None:
        if not self._alone():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._alone():
            return obj
        if isinstance(obj, torch.Tensor):
            dist.broadcast(obj, src)
            self._held.append(obj)
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @override
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self._alone():
            return tensor
        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"all_reduce op={op!r} is not supported; use one of {sorted(ops)}")
        dist.all_reduce(tensor, op=ops[op])
        self._held.append(tensor)
        if op == "mean":
            tensor /= self.world_size
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return tensor.unsqueeze(0)
        flat = tensor.contiguous().reshape(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        _all_gather_single(out, flat)
        self._held.append((flat, out))
        return out.view(self.world_size, *tensor.shape)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns FutureWarning); older ones have
# only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class MeshStrategy(ProcessGroupStrategy):
    """Strategies whose parameters are DTensors on a device mesh (FSDP2, TensorParallel, 2D).

    A subclass builds ``self.mesh`` in ``setup_environment`` and shards the module in ``setup_module``;
    setup (optimizer rebinding included), whole parameters on demand, clipping, the FP16 overflow vote,
    memory reports and checkpoints are shared here. The pieces both engines use (block detection,
    the mixed-precision policy, the rank-0 broadcast) are in :mod:`shardkit.strategies._dtensor`.
    """

    mesh: DeviceMesh | None = None

    @property
    @override
    def partitions_parameters(self) -> bool:
        return True

    @property
    @override
    def optimizer_parameters(self) -> str:
        return "shards"

    @override
    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None):
        names = _dtensor.parameter_names(module)
        module = self.precision.convert_module(module)
        if not _dtensor.has_meta_parameters(module):  # meta parameters are allocated shard by shard in setup_module
            module = module.to(self.root_device)
        module = self.setup_module(module)
        if optimizer is not None:
            _dtensor.rebind_optimizer(optimizer, names, module)
            optimizer = self.setup_optimizer(optimizer)
        return module, optimizer, scheduler

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # sharded in place: the module is the user's own

    @override
    def gathered_parameters(self, params: Any, modifier_rank: int | None = None,
                            module: nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Context that yields ``params`` as plain whole tensors (DTensors gathered over their mesh).

        See :meth:`Strategy.gathered_parameters`; with ``modifier_rank=r`` rank r's writes are kept.
        """
        return _dtensor.gathered_parameters(param_list(params), modifier_rank, module)

    @override
    def generation_context(self, module: nn.Module,
                           keep_unsharded: bool | None = None) -> contextlib.AbstractContextManager[str | None]:
        """FSDP2 units (FSDP, and TP's data-parallel dimension) stay gathered across decoding steps when the
        extra bytes fit in half the free memory on every rank, or as ``keep_unsharded`` says."""
        from shardkit.strategies._unshard import fsdp_unsharded

        return fsdp_unsharded(module, self.root_device, keep_unsharded, self._any_rank)

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.root_device)
        return bool(self.all_reduce(t, "max").item())

    @override
    def set_gradient_sync(self, module: nn.Module, enabled: bool) -> None:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled)

    @override
    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return _dtensor.clip_grad_norm(params, max_norm, norm_type)

    @override
    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        """The sharded gradients, and those of an abandoned window that FSDP2 units (FSDP, TP's dp="fsdp",
        ContextParallel) still hold unsharded."""
        super().zero_grad(optimizer, module)
        _dtensor.drop_unreduced_gradients(module)

    @override
    def _reduce_found_inf(self, flag: torch.Tensor) -> torch.Tensor:
        # Each rank sees only its gradient shards: an inf anywhere must skip the step on every rank.
        return _dtensor.reduce_max(flag)

    @override
    def model_state_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (its shards)."""
        return _dtensor.model_state_bytes(module, optimizer)

    # Checkpoints: each rank writes its own shards (or rank 0 the gathered tensors, with
    # state_dict_type="full"); loading reads exactly the region each local shard covers, so a save
    # loads on any world size or mesh.

    @override
    def save_module(self, writer: ckpt.CheckpointWriter, name: str, module: nn.Module) -> None:
        _sharded_state.save_module_state(writer, name, module, self.rank, self._full_state_dict)

    @override
    def load_module(self, reader: ckpt.CheckpointReader, name: str, module: nn.Module) -> None:
        _sharded_state.load_module_state(reader, name, module)

    @override
    def save_optimizer(self, writer: ckpt.CheckpointWriter, name: str, optimizer: torch.optim.Optimizer,
                       module: nn.Module) -> None:
        _sharded_state.save_optimizer_state(writer, name, optimizer, module, self.rank, self._full_state_dict)

    @override
    def load_optimizer(self, reader: ckpt.CheckpointReader, name: str, optimizer: torch.optim.Optimizer,
                       module: nn.Module) -> None:
        _sharded_state.load_optimizer_state(reader, name, optimizer, module)

    @override
    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, module: nn.Module, state: dict[str, Any]) -> None:
        _sharded_state.load_full_optimizer_state(optimizer, module, state)

    @property
    def _full_state_dict(self) -> bool:
        return self.settings.state_dict_type == "full"
