"""Base of the strategies that run one process per device in a process group."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from shardkit import checkpoint as ckpt
from shardkit.distributed.process_group import destroy_distributed, init_distributed
from shardkit.strategies import _mesh, _sharded_state
from shardkit.strategies.base import BackwardSyncControl, Strategy

__all__ = ["ProcessGroupStrategy", "MeshStrategy"]


class ProcessGroupStrategy(Strategy):
    """One process per device, joined in a process group: NCCL on GPUs, gloo on CPUs.

    Args:
        timeout: seconds a collective may wait before the job fails (default: SHARDKIT_COLLECTIVE_TIMEOUT
            or 1800), so that a dead rank ends the job instead of hanging it.
    """

    def __init__(self, timeout: float | None = None):
        super().__init__()
        self.timeout = timeout
        self._device: torch.device | None = None
        self._local_rank = 0
        self._local_world_size = 1

    @property
    @override
    def root_device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError(f"{type(self).__name__}'s device is known after setup_environment(); "
                               "create the Runner first")
        return self._device

    @property
    @override
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @override
    def setup_environment(self) -> None:
        env = init_distributed(self.device_type, timeout=self.timeout)
        self._local_rank, self._local_world_size = env.local_rank, env.local_world_size
        self._device = torch.device("cuda", env.local_rank) if self.device_type == "cuda" else torch.device("cpu")
        super().setup_environment()

    @override
    def teardown(self) -> None:
        destroy_distributed()  # drains the group's workers (see there) while we still hold the tensors
        self._held.clear()  # freed here, by this thread, with the GIL: see Strategy.__init__


class MeshStrategy(BackwardSyncControl, ProcessGroupStrategy):
    """Strategies whose parameters are DTensors on a device mesh (FSDP2, TensorParallel, 2D)."""

    mesh: DeviceMesh | None = None

    @override
    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # sharded in place: the module is the user's own

    @override
    def set_gradient_sync(self, module: nn.Module, enabled: bool) -> None:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled)

    @override
    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return _mesh.clip_grad_norm(params, max_norm, norm_type)

    @override
    def _reduce_found_inf(self, flag: torch.Tensor) -> torch.Tensor:
        # Each rank sees only its gradient shards: an inf anywhere must skip the step on every rank.
        return _mesh.reduce_max(flag)

    @override
    def model_state_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (its shards)."""
        return _mesh.model_state_bytes(module, optimizer)

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

    @property
    def _full_state_dict(self) -> bool:
        return self.settings.state_dict_type == "full"
