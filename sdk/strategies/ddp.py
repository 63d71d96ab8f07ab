"""Data parallel on torch DDP: every rank holds the full model; gradients are all-reduced."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from shardkit.strategies.parallel import ProcessGroupStrategy

__all__ = ["DDP", "DDPSettings"]


@dataclass(frozen=True)
class DDPSettings:
    """Settings of torch DDP that users tune.

    Args:
        bucket_cap_mb: gradient bucket size; larger buckets mean fewer, bigger all-reduces.
        find_unused_parameters: allow parameters that get no gradient in a step (costs a graph walk).
        static_graph: promise the same graph every step (enables extra overlap).
        gradient_as_bucket_view: gradients alias the buckets (saves one copy of gradient memory).
    """

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"DDP bucket_cap_mb={self.bucket_cap_mb} must be > 0")


class DDP(ProcessGroupStrategy):
    """torch DistributedDataParallel; NCCL on GPUs and gloo on CPUs, chosen from the device.

    Gradients are reduced in the precision's ``comm_dtype`` (fp32 unless set otherwise), whatever
    dtype the parameters have.

    Args:
        bucket_cap_mb, find_unused_parameters, static_graph, gradient_as_bucket_view: see DDPSettings.
        timeout: seconds a collective may wait before the job fails (default: SHARDKIT_COLLECTIVE_TIMEOUT
            or 1800).
    """

    needs_group = False  # one process without a launcher runs the module as it is (see setup_module)

    def __init__(
        self, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False, static_graph: bool = False,
        gradient_as_bucket_view: bool = True, timeout: float | None = None,
    ):
        super().__init__(timeout)
        self.settings = DDPSettings(bucket_cap_mb, find_unused_parameters, static_graph, gradient_as_bucket_view)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if not dist.is_initialized():
            # NOTE: one process that no launcher started (an Accelerate YAML with MULTI_CPU and num_processes: 1)
            # has no group, and torch's DDP cannot wrap without one. Nothing is reduced at world size 1, so the
            # module runs as it is: the same losses and weights as SingleDevice.
            return module
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            module, device_ids=device_ids, bucket_cap_mb=self.settings.bucket_cap_mb,
            find_unused_parameters=self.settings.find_unused_parameters, static_graph=self.settings.static_graph,
            gradient_as_bucket_view=self.settings.gradient_as_bucket_view,
        )
        grad_dtype = next((p.dtype for p in module.parameters() if p.requires_grad), torch.float32)
        if self.precision.comm_dtype != grad_dtype:
            wrapped.register_comm_hook(None, _cast_allreduce_hook(self.precision.comm_dtype))
        return wrapped

    @override
    def set_gradient_sync(self, module: nn.Module, enabled: bool) -> None:
        # What DDP.no_sync() toggles; read at the start of forward, so the Runner sets it ahead of it.
        module.require_backward_grad_sync = enabled



def _cast_allreduce_hook(comm_dtype: torch.dtype):
    """DDP comm hook that averages each bucket in ``comm_dtype`` and casts back to the gradient dtype."""

    held: collections.deque = collections.deque(maxlen=16)  # see ProcessGroupStrategy.__init__ on gloo and the GIL

    def hook(process_group, bucket):
        buffer = bucket.buffer()
        group = process_group if process_group is not None else dist.group.WORLD
        reduced = buffer.to(comm_dtype).div_(dist.get_world_size(group))
        held.append(reduced)
        future = dist.all_reduce(reduced, group=group, async_op=True).get_future()

        def cast_back(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(cast_back)

    return hook
