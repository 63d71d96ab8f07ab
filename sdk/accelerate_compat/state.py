"""Accelerate's state objects on shardkit: the process facts of the job and the accumulation window.

``PartialState`` and ``AcceleratorState`` read every fact (rank, world size, device) and run every collective
through one :class:`shardkit.Strategy`: the strategy of the latest ``Accelerator``, or, before there is one, the
strategy ``Runner()`` would pick (DDP under a launcher, else SingleDevice). As in Accelerate, every
``PartialState()`` of a process shares that state. ``GradientState`` is per ``Accelerator`` here: two
Accelerators in one process keep their own accumulation windows.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from typing_extensions import override

from shardkit.strategies.base import Strategy, StrategyFamily

__all__ = ["AcceleratorState", "DistributedType", "GradientState", "PartialState", "distributed_type_of",
           "forget_state", "shared_strategy", "use_strategy"]

# The strategy every PartialState of this process reads (Accelerate keeps its state in a shared dict as well).
_SHARED: dict[str, Any] = {}


class DistributedType(str, enum.Enum):
    """Accelerate's names for the kind of job; compares equal to ``accelerate.utils.DistributedType``'s members."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"

    def __str__(self) -> str:
        return self.value


def distributed_type_of(strategy: Strategy) -> DistributedType:
    """Accelerate's ``DistributedType`` for a strategy, from the family it declares (``Strategy.family``)."""
    family = strategy.family
    if family is StrategyFamily.FSDP:
        return DistributedType.FSDP
    if family is StrategyFamily.DEEPSPEED:
        return DistributedType.DEEPSPEED
    if family is StrategyFamily.SINGLE or strategy.world_size == 1:
        return DistributedType.NO
    return DistributedType.MULTI_GPU if strategy.root_device.type == "cuda" else DistributedType.MULTI_CPU


def use_strategy(strategy: Strategy) -> None:
    """Make ``strategy`` the one every PartialState of this process reads (an Accelerator calls it)."""
    _SHARED["strategy"] = strategy


def forget_state() -> None:
    """Drop the shared state (after the process group is destroyed, or in a freshly forked process): the next
    PartialState joins the job the environment describes."""
    _SHARED.clear()


def shared_strategy(cpu: bool = False) -> Strategy:
    """The process's shared strategy, made (and its process group joined) on first use."""
    strategy = _SHARED.get("strategy")
    if strategy is None:
        from shardkit.accelerate_compat.plugins import default_strategy

        strategy = default_strategy(cpu)
        strategy.setup_environment()
        _SHARED["strategy"] = strategy
    return strategy


class ProcessFacts:
    """What Accelerate's states and Accelerator say about this process, read from :attr:`_strategy`."""

    @property
    def debug(self) -> bool:
        """Accelerate's operation checker: collectives first compare shapes across processes (one object gather
        each) and name a mismatch. Shared by every state of the process; ``ACCELERATE_DEBUG_MODE=1`` turns it on."""
        default = os.environ.get("ACCELERATE_DEBUG_MODE", "").lower() in ("1", "true", "yes")
        return bool(_SHARED.get("debug", default))

    @debug.setter
    def debug(self, value: bool) -> None:
        _SHARED["debug"] = bool(value)

    @property
    def _strategy(self) -> Strategy:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self._strategy.root_device

    @property
    def process_index(self) -> int:
        return self._strategy.rank

    @property
    def local_process_index(self) -> int:
        return self._strategy.local_rank

    @property
    def num_processes(self) -> int:
        return self._strategy.world_size

    @property
    def distributed_type(self) -> DistributedType:
        """Accelerate's name for the strategy's kind (an assignment overrides it for every state of the process,
        as Accelerate's shared state does; ``AcceleratorState._reset_state()`` drops the override)."""
        return _SHARED.get("distributed_type") or distributed_type_of(self._strategy)

    @distributed_type.setter
    def distributed_type(self, value: Any) -> None:
        _SHARED["distributed_type"] = DistributedType(str(getattr(value, "value", value)))

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call."""
        self._strategy.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the local main process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    def main_process_first(self) -> contextlib.AbstractContextManager:
        """The main process runs the block first, the others after it (e.g. to download or preprocess once)."""
        return self._first(self.is_main_process)

    def local_main_process_first(self) -> contextlib.AbstractContextManager:
        """Like :meth:`main_process_first`, once per machine."""
        return self._first(self.is_local_main_process)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> contextlib.AbstractContextManager:
        """Context yielding this process's contiguous share of ``inputs`` (list, tuple, tensor, dict of them, or a
        dataset with ``select``); with ``apply_padding`` every process gets as many (short ones repeat the last)."""
        from shardkit.inference import split_between_processes

        s = self._strategy
        return split_between_processes(inputs, apply_padding, dp_rank=s.data_parallel_rank,
                                       dp_size=s.data_parallel_size)

    def _on(self, function: Callable | None, when: Callable[[], bool]) -> Callable:
        if function is None:  # used as @state.on_process(process_index=1)
            return functools.partial(self._on, when=when)

        @functools.wraps(function)
        def runs_where_asked(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if when() else None

        return runs_where_asked

    def on_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: the function runs on the main process only (None elsewhere)."""
        return self._on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None) -> Callable:
        """Decorator: the function runs on each machine's main process only."""
        return self._on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable | None = None) -> Callable:
        """Decorator: the function runs on the last process only."""
        return self._on(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorator: the function runs on process ``process_index`` only."""
        return self._on(function, lambda: self.process_index == _index(process_index, "process_index"))

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        """Decorator: the function runs on local process ``local_process_index`` of each machine only."""
        return self._on(function, lambda: self.local_process_index == _index(local_process_index,
                                                                              "local_process_index"))

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave and destroy the process group (every process must call it)."""
        from shardkit.distributed import destroy_distributed

        destroy_distributed()
        forget_state()

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")


def _index(value: int | None, name: str) -> int:
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be given as a whole number (the process to run on), got {value!r}")
    return value


class PartialState(ProcessFacts):
    """Accelerate's ``PartialState``: the process facts and process-level helpers, without an Accelerator.

    Args:
        cpu: run on the CPU even where a GPU is visible (one process).
        **kwargs: Accelerate's process-group options; ``backend`` and ``timeout`` are honoured as
            :class:`~shardkit.accelerate_compat.plugins.InitProcessGroupKwargs` are.
    """

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        if kwargs:
            from shardkit.accelerate_compat.plugins import InitProcessGroupKwargs, apply_init_kwargs

            apply_init_kwargs(InitProcessGroupKwargs(**kwargs))
        shared_strategy(cpu)

    @property
    @override
    def _strategy(self) -> Strategy:
        return shared_strategy()

    @property
    def initialized(self) -> bool:
        return "strategy" in _SHARED


class AcceleratorState(PartialState):
    """Accelerate's ``AcceleratorState``: :class:`PartialState` plus the Accelerator's precision and plugins."""

    @property
    def mixed_precision(self) -> str:
        """"no", "fp16" or "bf16", from the precision of the Accelerator's Runner."""
        precision = getattr(self._strategy, "precision", None)
        return mixed_precision_name(precision.compute_dtype if precision is not None else torch.float32)

    @property
    def deepspeed_plugin(self) -> Any:
        return _SHARED.get("deepspeed_plugin")

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Drop what was set on the shared state (a ``distributed_type`` override, ``debug``), as test suites call it
        between cases; the process group and the Accelerators built so far stay usable."""
        for key in ("distributed_type", "debug"):
            _SHARED.pop(key, None)

    @property
    def fsdp_plugin(self) -> Any:
        return _SHARED.get("fsdp_plugin")


def mixed_precision_name(compute_dtype: torch.dtype) -> str:
    """Accelerate's ``mixed_precision`` word for a compute dtype."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(compute_dtype, "no")


def remember_plugins(deepspeed: Any = None, fsdp: Any = None) -> None:
    """What ``AcceleratorState().deepspeed_plugin`` / ``.fsdp_plugin`` answer (the latest Accelerator's)."""
    _SHARED["deepspeed_plugin"], _SHARED["fsdp_plugin"] = deepspeed, fsdp


class GradientState:
    """Where an Accelerator is in its accumulation window and in its data loaders.

    Attributes:
        num_steps: micro-batches per optimizer step.
        adjust_scheduler: a skipped (mid-window) scheduler step still counts toward ``_step_count``.
        sync_with_dataloader: the last batch of a data loader ends the window.
        sync_each_batch: reduce gradients on every micro-batch (no ``no_sync`` inside ``accumulate``).
        sync_gradients: Accelerate's meaning: True from the ``accumulate`` entry of the micro-batch that ends a
            window (its backward reduces and ``optimizer.step()`` steps) until the next ``accumulate`` entry.
    """

    def __init__(self, num_steps: int = 1, adjust_scheduler: bool = True, sync_with_dataloader: bool = True,
                 sync_each_batch: bool = False) -> None:
        self.num_steps = num_steps
        self.adjust_scheduler = adjust_scheduler
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_each_batch = sync_each_batch
        self.sync_gradients = True
        self._loaders: list[Any] = []  # the prepared loaders being iterated, innermost last

    @property
    def plugin_kwargs(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "adjust_scheduler": self.adjust_scheduler,
                "sync_with_dataloader": self.sync_with_dataloader, "sync_each_batch": self.sync_each_batch}

    @property
    def active_dataloader(self) -> Any:
        """The prepared data loader being iterated (the innermost one), or None."""
        return self._loaders[-1] if self._loaders else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self._loaders)

    @property
    def end_of_dataloader(self) -> bool:
        """True while the active data loader yields its last batch."""
        return bool(self._loaders) and self._loaders[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real samples in the active loader's last gathered batch, -1 when unknown (as Accelerate)."""
        return self._loaders[-1].remainder if self._loaders else -1

    def _add_dataloader(self, loader: Any) -> None:
        self._loaders.append(loader)

    def _remove_dataloader(self, loader: Any) -> None:
        for i in range(len(self._loaders) - 1, -1, -1):
            if self._loaders[i] is loader:
                del self._loaders[i]
                return

    def __repr__(self) -> str:
        return (f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
                f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n")
