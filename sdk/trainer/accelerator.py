"""``trainer.accelerator``: what scripts written for Hugging Face's Trainer ask its Accelerate object, answered
from shardkit's Runner.

There is no Accelerate ``Accelerator`` inside shardkit's Trainer: the Runner holds the strategy and precision.
This view is a thin adapter over shardkit's Accelerate front (:mod:`shardkit.accelerate_compat`): the process
facts (``is_main_process``, ``num_processes``, ``device``, ``distributed_type``, ``print``,
``wait_for_everyone``, ``main_process_first`` ...) are its :class:`~shardkit.accelerate_compat.state.ProcessFacts`
read from the Trainer's strategy, so both fronts give one answer. What only a Trainer has (``unwrap_model``,
``state.fsdp_plugin``, ``gather_for_metrics`` on the Runner ...) is here; anything else is refused naming the
shardkit equivalent instead of failing with a bare AttributeError.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardkit.accelerate_compat.state import ProcessFacts, mixed_precision_name

__all__ = ["AcceleratorView", "FSDPPluginView"]

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
        return self._owner.fsdp_plugin

    @property
    def deepspeed_plugin(self) -> Any:
        trainer = self._owner.trainer
        return trainer.deepspeed_config if trainer.is_deepspeed_enabled else None

    @property
    def distributed_type(self) -> Any:
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


class AcceleratorView(ProcessFacts):
    """The ``trainer.accelerator`` of a shardkit Trainer (see the module docstring)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.fsdp_plugin = FSDPPluginView(trainer.runner.strategy) if trainer.is_fsdp_enabled else None
        self.state = _StateView(self)

    @property
    def _strategy(self) -> Any:  # what ProcessFacts reads every fact from
        return self.trainer.runner.strategy

    @property
    def _runner(self) -> Any:
        return self.trainer.runner

    @property
    def mixed_precision(self) -> str:
        """Accelerate's word for the Runner's precision: "no", "fp16" or "bf16"."""
        return mixed_precision_name(self._runner.precision.compute_dtype)

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
