"""The Strategy base: where parameters, gradients and optimizer state live, and how ranks talk.

A subclass overrides a handful of methods; everything else has a working default for a module
whose full state every rank holds (SingleDevice, DDP). Sharded strategies override the state
and checkpoint hooks. The base knows nothing of process groups: rank 0 of a world of one, until a
subclass says otherwise (:class:`shardkit.strategies.parallel.ProcessGroupStrategy` holds the
collectives and the process-group plumbing). The contract each method keeps is in ``strategies/README.md``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from shardkit import checkpoint as ckpt
from shardkit.precision import FP32, Precision
from shardkit.strategies.facts import MemoryJob, StateBytes, StrategyFamily

if TYPE_CHECKING:
    from shardkit.strategies.parallel_dims import ParallelDims

__all__ = ["Strategy", "StrategyFamily", "param_list", "replicated_gathered"]


class Strategy(ABC):
    """Base class of every strategy. The Runner holds one and delegates to it.

    Attributes:
        family: the engine family the fronts report (see :class:`StrategyFamily`); a class declaration that
            subclasses inherit, or a property where a setting picks the engine (TensorParallel's and Pipeline's
            ``dp="fsdp"``).
        dims: the sizes of every parallel dimension (:class:`~shardkit.strategies.parallel_dims.ParallelDims`)
            where the strategy builds a device mesh from them, resolved against the world in
            ``setup_environment``; None where it has none (SingleDevice, DDP, ZeRO).
        keeps_master_copy: the engine holds parameters and gradients in the compute dtype beside a separate
            fp32 master copy it steps on (DeepSpeed, even in fp32); False: the parameters, in the precision's
            parameter dtype, are what the optimizer steps (torch engines). The memory estimate reads it.
    """

    family: StrategyFamily = StrategyFamily.SINGLE
    dims: ParallelDims | None = None
    keeps_master_copy: bool = False

    def __init__(self) -> None:
        self._precision: Precision = FP32()

    # ---- wiring --------------------------------------------------------------------------------

    @property
    def precision(self) -> Precision:
        return self._precision

    def connect(self, precision: Precision) -> None:
        """Give the strategy the precision it asks for dtypes, contexts and engine config."""
        self._precision = precision

    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this rank computes on."""

    @property
    def rank(self) -> int:
        """This process's rank among all processes of the job."""
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        """How many processes the job has."""
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the replicas that take different batches (tensor-parallel peers share one)."""
        return self.rank

    @property
    def data_parallel_size(self) -> int:
        """How many different batches are processed per micro-step across the job."""
        return self.world_size

    @property
    def partitions_parameters(self) -> bool:
        """Whether a rank holds only part of each parameter between steps (ZeRO-3, FSDP, TensorParallel), so
        whole weights exist only inside ``gathered_parameters``. False: every rank holds every weight whole."""
        return False

    @property
    def optimizer_parameters(self) -> str:
        """What an optimizer over the set-up model steps: ``"whole"`` tensors on every rank (the default),
        ``"shards"`` (each rank's DTensor shards: FSDP, TensorParallel) or ``"flat"`` (one flat 1-d partition
        per param group: the ZeRO engines). An optimizer that needs whole matrices (GaLore) or per-parameter
        state (GrokAdamW, LOMO) asks this instead of checking the strategy's class."""
        return "whole"

    def parameter_numel(self, param: torch.Tensor) -> int:
        """Elements of ``param`` as the model defines it, however this strategy holds it between steps (a
        ZeRO-3 partition counts whole). A DTensor's ``numel()`` is already its global size."""
        return param.numel()

    def parameter_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        """Shape of ``param`` as the model defines it, however this strategy holds it between steps (a ZeRO-3
        partition has its whole shape). A DTensor's ``shape`` is already its global one."""
        return tuple(param.shape)

    def model_state_memory(self, job: MemoryJob) -> StateBytes:
        """Bytes of parameters, gradients and optimizer state one rank holds under this strategy, with its
        settings, for ``job`` (what ``shardkit estimate-memory`` prints). The default: every rank holds the whole
        model with its gradients and states (SingleDevice, DDP). A strategy that places them otherwise overrides it."""
        return StateBytes.replicated(job)

    def setup_environment(self) -> None:
        """Bring up the process group and device; called once by the Runner before any setup."""
        self.precision.setup_environment(self.root_device)

    def teardown(self) -> None:
        """Release what :meth:`setup_environment` acquired."""

    # ---- modules and optimizers ----------------------------------------------------------------

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """Context to build a model in: on the device, in the precision's parameter dtype."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @abstractmethod
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Move/wrap a module for this strategy (DDP wrapper, FSDP sharding, ...)."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt an optimizer built over the setup module's parameters; identity by default."""
        return optimizer

    def set_runner_values(
        self, gradient_accumulation_steps: int | None = None, micro_batch_size: int | None = None
    ) -> None:
        """Told by the Runner (the single source of truth) before setup; engines that need these
        numbers in their own config (DeepSpeed) record them."""

    def setup(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any | None
    ) -> tuple[nn.Module, torch.optim.Optimizer | None, Any | None]:
        """Set up the three together. Engines that own all three (DeepSpeed) override this."""
        module = self.setup_module(self.precision.convert_module(module).to(self.root_device))
        if optimizer is not None:
            _move_optimizer_state(optimizer, self.root_device)
            optimizer = self.setup_optimizer(optimizer)
        return module, optimizer, scheduler

    def generation_context(self, module: nn.Module,
                           keep_unsharded: bool | None = None) -> contextlib.AbstractContextManager[str | None]:
        """Context around one generate call on ``module`` (the user's model, set up by this strategy), entered
        on every rank; yields how the parameters are handled during the call, for the log, or None.

        Strategies that partition parameters override it: FSDP keeps them gathered across decoding steps
        when memory allows (``keep_unsharded`` forces either way). The default does nothing.
        """
        return contextlib.nullcontext(None)

    @property
    def generation_is_local(self) -> bool:
        """Whether :meth:`generation_context` talks to no other rank: true where the strategy keeps this default,
        which holds nothing; a strategy that overrides it (to gather or hold parameters) is taken to need its peers.
        Synced generation skips every collective for a call whose parameters are all whole and whose context is
        local."""
        return type(self).generation_context is Strategy.generation_context

    def configure_activation_checkpointing(self, settings: Any) -> None:
        """Hand engine-specific activation-checkpointing options to the engine, after :meth:`setup`.

        ``settings`` is the Runner's :class:`~shardkit.strategies.ActivationCheckpointing` (the blocks are
        already patched, the same way under every strategy). Nothing to do in a world of one.
        """

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper the strategy added."""
        return getattr(module, "module", module)

    def gathered_parameters(
        self, params: Any, modifier_rank: int | None = None, module: nn.Module | None = None
    ) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Context that yields ``params`` as plain, whole tensors (a list, in the order given).

        Every rank must enter it (sharded strategies gather). With ``modifier_rank=r``, in-place
        changes rank r makes to the yielded tensors are kept on every rank on exit; other ranks'
        changes are dropped. Where ``module`` holds the parameters, reading them from the module inside
        the block gives the whole tensors too. Replicated strategies yield the parameters themselves.
        """
        return contextlib.nullcontext(param_list(params))  # one process: the parameters are whole and the only copy

    def iter_full_state_dict(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream the model's full state dict to the main process, one module at a time.

        Yields ``(name, tensor)`` with the keys and order of ``module.state_dict()`` (tied weights under
        each name): whole tensors in the dtype the model holds them, detached copies on the CPU. Only one
        module's parameters are gathered at a time, so peak memory is the largest module, not the model.
        Every rank must drive the iterator to the end (the gathers are collectives); ranks other than the
        main process yield nothing.

        Example:
            for name, tensor in runner.iter_full_state_dict(model):   # on every rank
                writer.add(name, tensor)                               # runs on rank 0 only
        """
        main = self.is_global_zero
        for prefix, sub in _modules_like_state_dict(self.unwrap(module)):
            named = [(n, p) for n, p in sub._parameters.items() if p is not None]
            with self.gathered_parameters([p for _, p in named]) as whole:
                if main:
                    for (n, _), t in zip(named, whole):
                        yield prefix + n, t.detach().to("cpu", copy=True)
            if main:
                skip = sub._non_persistent_buffers_set
                for n, b in sub._buffers.items():
                    if b is not None and n not in skip:
                        yield prefix + n, b.detach().to("cpu", copy=True)

    def model_state_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds (for memory reports)."""
        params = [p for p in module.parameters()]
        state = optimizer.state.values() if optimizer is not None else []
        return {
            "params": sum(_local_bytes(p) for p in params),
            "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_local_bytes(v) for s in state for v in s.values() if isinstance(v, torch.Tensor)),
        }

    # ---- the step ------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, module: nn.Module, accumulation_steps: int) -> None:
        """Backward of one micro-batch: the loss is averaged over the accumulation window and scaled."""
        self.precision.scale_loss(loss / accumulation_steps).backward()

    def set_gradient_sync(self, module: nn.Module, enabled: bool) -> None:
        """Whether the next backward reduces gradients across ranks; no-op without a sync to skip."""

    def set_window(self, size: int) -> None:
        """The accumulation window that starts now holds ``size`` micro-batches (the Runner's ``begin_window``, or
        ``gradient_accumulation_steps`` again); no-op for strategies that get it in ``backward``."""

    def clip_gradients(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Unscale, then clip the gradients to ``max_norm``; return the total norm before clipping."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=True)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> bool:
        """Step the optimizer through the precision; False if the step was skipped."""
        return self.precision.optimizer_step(optimizer, found_inf=self._reduce_found_inf)

    def zero_grad(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        optimizer.zero_grad(set_to_none=True)

    def _reduce_found_inf(self, flag: torch.Tensor) -> torch.Tensor:
        # After an all-reduce the gradients agree, so this MAX only matters when a rank's gradients
        # were changed afterwards; one scalar per step (FP16 only) buys the guarantee that every
        # rank skips together and replicas never drift.
        return self.all_reduce(flag.to(self.root_device), "max")

    # ---- collectives ---------------------------------------------------------------------------
    # The Runner calls these four; every rank must call each one (they are collectives where there is
    # more than one rank). SingleDevice answers them locally; ProcessGroupStrategy runs them on the group.

    @abstractmethod
    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank has reached this call (``name`` labels it in logs and errors)."""

    @abstractmethod
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object (or a tensor, in place) from ``src`` to every rank; return it."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks with "sum", "mean", "max" or "min" and return it."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack each rank's ``tensor`` (same shape on every rank) into a new leading dimension."""

    # ---- checkpoint hooks ----------------------------------------------------------------------
    # Defaults for replicated state: rank 0 writes the full tensors. Sharded strategies override
    # these four to write one shard per rank with the metadata needed to reassemble.

    def save_module(self, writer: ckpt.CheckpointWriter, name: str, module: nn.Module) -> None:
        if self.is_global_zero:
            state = {k: v.detach() for k, v in self.unwrap(module).state_dict().items()}
            writer.write_tensors(name, state)

    def load_module(self, reader: ckpt.CheckpointReader, name: str, module: nn.Module) -> None:
        # A sharded entry (saved by FSDP, ZeRO, TP) is reassembled here, so any checkpoint loads
        # into a replicated strategy whatever world size saved it.
        if reader.entries().get(name) == "sharded":
            target = self.unwrap(module).state_dict()
            tensors = {key: tensor for key, tensor in reader.iter_full_tensors(name)}
            for key in target.keys() - tensors.keys():  # tied weights are stored once
                alias = next((k for k, v in target.items() if v is target[key] and k in tensors), None)
                if alias is not None:
                    tensors[key] = tensors[alias]
        else:
            tensors = reader.read_tensors(name)
        self.unwrap(module).load_state_dict(tensors, strict=True)

    def save_optimizer(
        self, writer: ckpt.CheckpointWriter, name: str, optimizer: torch.optim.Optimizer, module: nn.Module
    ) -> None:
        if self.is_global_zero:
            writer.write_state(name, ckpt.optimizer_state_by_name(optimizer, self.unwrap(module)))

    def load_optimizer(
        self, reader: ckpt.CheckpointReader, name: str, optimizer: torch.optim.Optimizer, module: nn.Module
    ) -> None:
        from shardkit.strategies._sharded_state import read_full_optimizer_state

        # Full or sharded (FSDP, TP, ZeRO), whatever world size saved it.
        self.load_optimizer_state(optimizer, module, read_full_optimizer_state(reader, name))

    def named_param_groups(self, optimizer: torch.optim.Optimizer, module: nn.Module) -> list[dict[str, Any]]:
        """The optimizer's param groups as this strategy steps them: each group's hyperparameters, with
        ``params`` the names of the model's parameters in it (the structure ``load_optimizer_state`` takes)."""
        return ckpt.optimizer_state_by_name(optimizer, self.unwrap(module))["param_groups"]

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, module: nn.Module, state: dict[str, Any]) -> None:
        """Load a whole-tensor optimizer state keyed by parameter name (``optimizer_state_by_name``'s structure,
        as a replicated run saves it) into ``optimizer`` at this strategy's layout: each rank takes its part.
        The path every full save takes, and a state read from another tool's file (Hugging Face's optimizer.pt)."""
        ckpt.load_optimizer_state_by_name(optimizer, self.unwrap(module), state)
        _move_optimizer_state(optimizer, self.root_device)

    def checkpoint_info(self) -> dict[str, Any]:
        """Facts written into a checkpoint's metadata (strategy name, world size, sharding)."""
        return {"strategy": type(self).__name__, "world_size": self.world_size}

    def checkpoint_scripts(self) -> dict[str, bytes]:
        """Tools a checkpoint of this strategy carries beside its files (``{name: bytes}``); none by default."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device})"


def param_list(params: Any) -> list[torch.Tensor]:
    """``params`` (one tensor, an iterable of them, or a module) as a list."""
    if isinstance(params, nn.Module):
        return list(params.parameters())
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


@contextlib.contextmanager
def replicated_gathered(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[list[torch.Tensor]]:
    """``gathered_parameters`` where every rank holds whole parameters: yields them; with ``modifier_rank``
    broadcasts that rank's values on exit, so replicas stay equal."""
    yield params
    if modifier_rank is not None and dist.is_initialized() and dist.get_world_size() > 1:
        seen: set[int] = set()
        with torch.no_grad():
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    dist.broadcast(p.data, src=modifier_rank)


def _modules_like_state_dict(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, module)`` in ``state_dict``'s order, a module shared under two names visited under each."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _modules_like_state_dict(child, f"{prefix}{name}.")


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step" and value.device != device:
                state[key] = value.to(device)
