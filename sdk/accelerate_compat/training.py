"""The training step of :class:`shardkit.Accelerator` (its ``training`` part): backward, the accumulation window,
clipping, the collectives.

Each method is the Strategy's or the Precision's: ``backward`` is ``strategy.backward`` (the loss averaged over
the window and scaled by the precision), ``no_sync`` is ``strategy.set_gradient_sync``, the prepared optimizer's
step is ``strategy.optimizer_step``, ``clip_grad_norm_`` is ``strategy.clip_gradients``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardkit.accelerate_compat import operations
from shardkit.accelerate_compat.parts import Prepared
from shardkit.accelerate_compat.state import DistributedType, GradientState, ProcessFacts
from shardkit.runner.core import Runner

__all__ = ["AcceleratorTraining"]

log = logging.getLogger("shardkit.accelerate")


class AcceleratorTraining:
    """Accelerate's step methods, which :class:`shardkit.Accelerator` forwards to. It owns the micro-batch count
    (``step``), whether the user clipped in this window and the trigger flag; it is handed the Runner, the
    accumulation window's state, what was prepared and the process facts (the Accelerator's, so that an assigned
    ``distributed_type`` counts here too). The prepared optimizers step through :meth:`optimizer_step`."""

    def __init__(self, runner: Runner, gradient_state: GradientState, prepared: Prepared, facts: ProcessFacts,
                 autocast_handler: Any = None) -> None:
        self.runner = runner
        self.gradient_state = gradient_state
        self.prepared = prepared
        self.facts = facts
        self.autocast_handler = autocast_handler
        self.step = 0  # micro-batches counted by accumulate() (saved by save_state)
        self._clipped = False  # clip_grad_norm_ ran in this window (a config's clipping then stays off)
        self._trigger = False

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    # ---- backward and the window ------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss`` divided by ``gradient_accumulation_steps``, scaled by the precision (fp16), through the
        strategy (DeepSpeed's engine under ZeRO). Use it in place of ``loss.backward()``."""
        if kwargs:
            raise NotImplementedError(f"accelerator.backward(loss, {', '.join(kwargs)}=...): shardkit's backward takes "
                                      f"the loss only")
        models = self.prepared.models
        module = models[0] if models else None
        self.runner.strategy.backward(loss, module, self.gradient_accumulation_steps)

    def _do_sync(self) -> None:
        """Count one micro-batch and decide whether it ends the window (Accelerate's rule)."""
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state.sync_gradients = True
        else:
            self.step += 1
            state.sync_gradients = self.step % state.num_steps == 0

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """Context for one micro-batch of a gradient accumulation window.

        Every ``gradient_accumulation_steps``-th micro-batch (and the last batch of a data loader) ends the
        window: :attr:`sync_gradients` is True, its backward reduces the gradients across processes, and the
        prepared optimizer's ``step()``/``zero_grad()`` and the prepared scheduler's ``step()`` act. On the other
        micro-batches they do nothing and ``models`` keep their gradients local (``no_sync``).
        """
        self._do_sync()
        state = self.gradient_state
        allow = state.sync_gradients or (self.facts.use_distributed and state.sync_each_batch)
        with contextlib.ExitStack() as stack:
            if not allow:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Context in which backward keeps ``model``'s gradients local (no reduction across processes); the next
        backward outside it reduces the accumulated gradients (the strategy's ``set_gradient_sync``)."""
        strategy = self.runner.strategy
        strategy.set_gradient_sync(model, False)
        try:
            yield
        finally:
            strategy.set_gradient_sync(model, True)

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        """Make the next backward reduce ``model``'s gradients although its forward ran under :meth:`no_sync`."""
        reducer = getattr(model, "reducer", None)
        if reducer is None:  # FSDP and ZeRO read the flag at backward time
            self.runner.strategy.set_gradient_sync(model, True)
            yield
            return
        # torch DDP decides in forward whether the coming backward reduces; after a no_sync forward its reducer
        # must be told to expect this backward's gradients (what DDP's forward would have done).
        previous = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = previous

    # ---- the step (called by the prepared optimizer) ----------------------------------------------------

    def optimizer_step(self, prepared: Any) -> bool:
        """The strategy's step for a prepared optimizer: a config's clipping if the user did not clip this window,
        then unscale, the overflow vote and the step. True when the step was taken."""
        module = self.prepared.owner_of(prepared)
        strategy, runner = self.runner.strategy, self.runner
        if runner.max_grad_norm and not self._clipped:
            strategy.clip_gradients(module, prepared.optimizer, runner.max_grad_norm)
        self._clipped = False
        stepped = strategy.optimizer_step(prepared.optimizer, module)
        if stepped:
            runner.record_step()
        return stepped

    def zero_grad(self, prepared: Any) -> None:
        """The strategy's ``zero_grad`` for a prepared optimizer and its model."""
        self.runner.strategy.zero_grad(prepared.optimizer, self.prepared.owner_of(prepared))

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step of any prepared optimizer was skipped for an fp16 overflow."""
        return any(opt.step_was_skipped for opt in self.prepared.optimizers)

    # ---- clipping ---------------------------------------------------------------------------------------

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the fp16 loss scale (once per step; clipping does it itself)."""
        optimizers = self.prepared.optimizers if optimizer is None else optimizer
        for opt in optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]:
            self.runner.precision.unscale_gradients(getattr(opt, "optimizer", opt))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients' total norm to ``max_norm`` and return the norm before clipping.

        For a prepared model's ``parameters()`` this is the strategy's clipping (unscaled first, the norm over the
        whole model however it is sharded). NOTE: under ZeRO DeepSpeed clips inside the step: the returned tensor
        holds the norm once ``optimizer.step()`` has run.
        """
        params = list(parameters)
        for acc in self.prepared.optimizers:
            module = self.prepared.owner_of(acc)
            if _same_parameters(params, list(module.parameters())):
                self._clipped = True
                return self.runner.strategy.clip_gradients(module, acc.optimizer, max_norm, norm_type)
        if self.facts.distributed_type == DistributedType.DEEPSPEED:
            raise NotImplementedError("under ZeRO, DeepSpeed clips a whole model: clip_grad_norm_(model.parameters(), "
                                      "max_norm) with the prepared model")
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]`` (after unscaling); not under FSDP or ZeRO."""
        distributed_type = self.facts.distributed_type
        if distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            raise NotImplementedError(f"clip_grad_value_ is not supported under {distributed_type} (as in "
                                      f"Accelerate); use clip_grad_norm_")
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ---- collectives ------------------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        """Each tensor (or nested list/tuple/dict of them) from every process, concatenated on the first dim."""
        return operations.gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Each tensor reduced over the processes ("sum", "mean", "max", "min", "none")."""
        return operations.reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad each tensor along ``dim`` to the largest size over the processes, so that it can be gathered."""
        return operations.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather per-sample results for metrics: every sample once.

        On the last batch of a prepared data loader the repeats that made the processes' batches even are
        dropped (tensor-parallel peers count once). Objects that are not tensors, or ``use_gather_object=True``,
        are gathered as Python objects (a list in process order).
        """
        try:
            operations.recursively_apply(lambda t: t, input_data, error_on_other_type=True)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        loader = self.gradient_state.active_dataloader
        base = getattr(loader, "base", None)
        mask = base.duplicate_mask() if base is not None else None
        if not tensors:
            data = operations.gather_object(input_data)
            if mask is not None and len(data) == mask.numel():
                data = [item for item, keep in zip(data, mask.tolist()) if keep]
            return data
        return operations.recursively_apply(lambda t: self._gather_samples(t, base, mask), input_data)

    def _gather_samples(self, tensor: torch.Tensor, base: Any, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            return operations.gather(tensor)
        if tensor.dim() == 0 or tensor.shape[0] * self.runner.strategy.data_parallel_size != mask.numel():
            log.warning("gather_for_metrics: a tensor of shape %s is not one row per sample of the last batch, so its "
                        "padding repeats cannot be dropped; it is gathered whole", tuple(tensor.shape))
            return operations.gather(tensor)
        return self.runner.gather_for_metrics(tensor, loader=base)

    # ---- process control --------------------------------------------------------------------------------

    def set_trigger(self) -> None:
        """Raise a flag on this process that :meth:`check_trigger` sees on every process (e.g. to stop early)."""
        self._trigger = True

    def check_trigger(self) -> bool:
        """True on every process when any process called :meth:`set_trigger` since the last check (a collective)."""
        flag = torch.tensor(1.0 if self._trigger else 0.0, device=self.runner.device)
        self.runner.strategy.all_reduce(flag, "max")
        self._trigger = False
        return bool(flag.item() > 0)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """torch's ``Join`` over DDP models, for loops whose processes run different numbers of batches
        (``even_batches=False``: evaluation without repeated samples).

        Args:
            joinables: the prepared DDP models (and other ``torch.distributed.algorithms.Joinable``).
            even_batches: for the duration of the block, the ``even_batches`` of every prepared loader over a
                map-style dataset (a streamed one keeps its own, with a warning).
        """
        distributed_type = self.facts.distributed_type
        if distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            warnings.warn(f"joining uneven inputs is only supported for multi-GPU and multi-CPU DDP training, not "
                          f"{distributed_type}; join_uneven_inputs has no effect", UserWarning, stacklevel=3)
            yield
            return
        from torch.distributed.algorithms.join import Join

        overridden = []
        if even_batches is not None:
            for loader in self.prepared.dataloaders:
                switch = loader.batch_sampler
                if hasattr(switch, "even_batches"):
                    overridden.append((switch, switch.even_batches))
                    switch.even_batches = even_batches
                else:
                    warnings.warn("overriding even_batches is only supported for map-style datasets; a prepared "
                                  "loader over an iterable dataset keeps its own", UserWarning, stacklevel=3)
        try:
            with Join(joinables):
                yield
        finally:
            for switch, value in overridden:
                switch.even_batches = value

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        """The precision's autocast (prepared models' forward already runs under it)."""
        from shardkit.accelerate_compat.plugins import to_kwargs

        handler = autocast_handler if autocast_handler is not None else self.autocast_handler
        if handler is not None and to_kwargs(handler):
            raise NotImplementedError(f"AutocastKwargs({to_kwargs(handler)}): shardkit's autocast is the precision's; "
                                      f"only the defaults are supported")
        return self.runner.autocast()


def _same_parameters(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
