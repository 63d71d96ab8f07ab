"""``trainer.accelerator``: what scripts written for Hugging Face's Trainer ask its Accelerate object, answered
from shardkit's Runner.

There is no Accelerate ``Accelerator`` inside shardkit's Trainer: the Runner holds the strategy and precision.
This view answers the common questions (``is_main_process``, ``num_processes``, ``device``, ``unwrap_model``,
``state.fsdp_plugin``, ``print``, ``wait_for_everyone``, ``gather_for_metrics`` ...) and names the shardkit
equivalent for anything else instead of failing with a bare AttributeError.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

__all__ = ["AcceleratorView", "FSDPPluginView"]

logger = logging.getLogger("shardkit.trainer")


class FSDPPluginView:
    """``accelerator.state.fsdp_plugin`` under FSDP: the settings scripts read or set.

    ``auto_wrap_policy`` and ``set_state_dict_type`` are accepted and have no effect: shardkit's FSDP shards
    the model's repeated blocks itself, and ``save_model()`` always streams the full state dict (one module at
    a time) into Hugging Face's format, whatever state dict type is set.
    """

    fsdp_version = 2

    def __init__(self, strategy: Any):
        self.strategy = strategy
        self.auto_wrap_policy: Any = None
        self.state_dict_type = "FULL_STATE_DICT"

    def _setting(self, name: str, default: Any) -> Any:
        return getattr(getattr(self.strategy, "settings", None), name, default)

    @property
    def sharding_strategy(self) -> str:
        return str(self._setting("sharding", "full"))

    @property
    def cpu_offload(self) -> bool:
        return bool(self._setting("cpu_offload", False))

    @property
    def sync_module_states(self) -> bool:
        return bool(self._setting("sync_module_states", True))

    @property
    def cpu_ram_efficient_loading(self) -> bool:
        return bool(self._setting("cpu_ram_efficient_loading", False))

    def set_state_dict_type(self, state_dict_type: str = "FULL_STATE_DICT") -> None:
        """Recorded only: save_model() writes the full state dict in Hugging Face's format under every strategy."""
        self.state_dict_type = str(state_dict_type)


class _StateView:
    def __init__(self, owner: AcceleratorView):
        self._owner = owner

    @property
    def fsdp_plugin(self) -> FSDPPluginView | None:
        return self._owner._plugin_view

    @property
    def deepspeed_plugin(self) -> Any:
        return self._owner._trainer.deepspeed_config if self._owner._trainer.is_deepspeed_enabled else None

    @property
    def distributed_type(self) -> str:
        return self._owner.distributed_type

    @property
    def num_processes(self) -> int:
        return self._owner.num_processes

    @property
    def process_index(self) -> int:
        return self._owner.process_index

    @property
    def mixed_precision(self) -> str:
        return self._owner.mixed_precision

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"trainer.accelerator.state has no {name!r}: shardkit's Trainer runs on a Runner "
                             "(trainer.runner), whose strategy and precision hold the settings")


class AcceleratorView:
    """The ``trainer.accelerator`` of a shardkit Trainer (see the module docstring)."""

    def __init__(self, trainer: Any):
        self._trainer = trainer
        self._plugin_view = FSDPPluginView(trainer.runner.strategy) if trainer.is_fsdp_enabled else None
        self.state = _StateView(self)

    @property
    def _runner(self) -> Any:
        return self._trainer.runner

    @property
    def is_main_process(self) -> bool:
        return self._runner.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._runner.local_rank == 0

    @property
    def num_processes(self) -> int:
        return self._runner.world_size

    @property
    def process_index(self) -> int:
        return self._runner.rank

    @property
    def local_process_index(self) -> int:
        return self._runner.local_rank

    @property
    def device(self) -> Any:
        return self._runner.device

    @property
    def distributed_type(self) -> str:
        """Accelerate's name for the strategy: NO, MULTI_GPU/MULTI_CPU (DDP), FSDP or DEEPSPEED."""
        if self._trainer.is_deepspeed_enabled:
            return "DEEPSPEED"
        if self._trainer.is_fsdp_enabled:
            return "FSDP"
        if self._runner.world_size > 1:
            return "MULTI_GPU" if self._runner.device.type == "cuda" else "MULTI_CPU"
        return "NO"

    @property
    def mixed_precision(self) -> str:
        args = self._trainer.args
        return "bf16" if args.bf16 else "fp16" if args.fp16 else "no"

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._runner.gradient_accumulation_steps

    @property
    def sync_gradients(self) -> bool:
        return self._runner.sync_gradients

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The user's module inside the strategy's wrapper (``runner.unwrap_model``); DataParallel too."""
        inner = self._runner.unwrap_model(model)
        return inner.module if isinstance(inner, nn.DataParallel) else inner

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        self._runner.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across every rank."""
        self._runner.barrier("accelerator.wait_for_everyone")

    def gather(self, tensor: Any) -> Any:
        """Every rank's tensor, stacked on a new first dimension then flattened into it (Accelerate's gather)."""
        gathered = self._runner.all_gather(tensor)
        return gathered.reshape(-1, *tensor.shape[1:]) if tensor.ndim else gathered

    def gather_for_metrics(self, tensor: Any) -> Any:
        """``gather`` without the padding duplicates of an uneven last batch (``runner.gather_for_metrics``)."""
        return self._runner.gather_for_metrics(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum") -> Any:
        """``runner.all_reduce`` ("sum" or "mean")."""
        return self._runner.all_reduce(tensor, reduction)

    def free_memory(self, *objects: Any) -> Any:
        """Release cached device memory (CUDA), as Accelerate's does; returns the objects set to None."""
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None for _ in objects] if len(objects) != 1 else None

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"trainer.accelerator has no {name!r}: shardkit's Trainer has no Accelerate object. "
                             "The Runner (trainer.runner) holds what Accelerate would: backward, clip_gradients, "
                             "step, save/load, all_reduce/all_gather/gather_for_metrics, unwrap_model, device")
