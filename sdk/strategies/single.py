"""One process, one device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from shardkit.strategies.base import Strategy

__all__ = ["SingleDevice", "default_device"]


def default_device() -> torch.device:
    """CUDA (this process's local rank) when present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SingleDevice(Strategy):
    """Train on one device in one process: rank 0 of a world of one, with no process group.

    Args:
        device: "cpu", "cuda", "cuda:1" or a torch.device; defaults to the first GPU if any, else CPU.
    """

    def __init__(self, device: str | torch.device | None = None):
        super().__init__()
        self._device = torch.device(device) if device is not None else default_device()
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", 0)

    @property
    @override
    def root_device(self) -> torch.device:
        return self._device

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return module.to(self._device)

    # The Runner's collectives over a world of one: nothing to wait for or exchange.

    @override
    def barrier(self, name: str | None = None) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)
