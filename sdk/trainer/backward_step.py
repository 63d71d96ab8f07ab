"""How the Trainer trains with optimizers that update the weights inside backward.

Two kinds, each recognised from the optimizer itself (so a user-built one works too):

- fused backward (LOMO, AdaLomo): ``optimizer.fused_backward(loss, lr)`` replaces the Runner's backward
  and applies the update from gradient hooks; with clipping, ``optimizer.grad_norm(loss)`` first (one
  more backward). The lr passed is the scheduler's current one (``param_groups[0]["lr"]``). At the end of
  the step the scheduler steps and the Runner's step count grows; ``runner.step()`` is not called (there
  is no gradient left and no optimizer step to take).
- layer-wise (:class:`shardkit.optim.layerwise.LayerwiseOptimizer`): the Runner's backward as usual,
  each parameter stepping in its post-accumulate hook; ``runner.step()`` then only steps the schedule
  (the optimizer's ``step()`` is a no-op) and clears gradients. ``max_grad_norm`` cannot apply (no total
  norm exists before the first parameter has stepped); a warning says so once.

Fused-backward optimizers run on one process or under DDP; layer-wise ones on one process only. Neither
accumulates gradients nor takes FP16 loss scaling. Anything else is refused at setup with
:class:`BackwardStepError`, naming the setting and the fix:

- gradient accumulation: the weights change during each micro-batch's backward (HF refuses it too).
- DDP, fused backward: the hooks would update each parameter from its local gradient before DDP's
  all-reduce, and the ranks would drift apart (lomo-optim 0.1.1 all-reduces only on its DeepSpeed-ZeRO-3
  path, which reads HF's global DeepSpeed state, never set by shardkit; HF's Trainer runs it anyway).
  So DDP's own sync is turned off and the optimizer's hook averages each gradient across ranks before
  using it (:meth:`BackwardStepper.setup`): one blocking all-reduce per parameter, no bucketing.
- DDP, layer-wise: refused (as HF does); each parameter steps in the hook that DDP's reduction follows.
- FSDP, ZeRO, tensor parallel: they replace or partition the parameters the hooks were registered on,
  and the ZeRO engines own the step.
- FP16: its loss scale and overflow check live in the Runner's step, which these updates bypass.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.optim import Optimizer

from shardkit.optim.named import OptimizerUnsupportedError

__all__ = ["BackwardStepError", "BackwardStepper", "backward_stepper"]

logger = logging.getLogger("shardkit.trainer")


class BackwardStepError(OptimizerUnsupportedError):
    """An optimizer that updates inside backward (LOMO, AdaLomo, layer-wise GaLore) cannot run with these
    settings (gradient accumulation; FSDP, ZeRO or TP; DDP for layer-wise; FP16); the message names the fix."""


def _kind(optimizer: Optimizer) -> str | None:
    from shardkit.optim.layerwise import LayerwiseOptimizer

    if callable(getattr(optimizer, "fused_backward", None)):
        return "fused"
    if isinstance(optimizer, LayerwiseOptimizer):
        return "layerwise"
    return None


def backward_stepper(optimizer: Optimizer, runner: Any, args: Any) -> BackwardStepper | None:
    """The driver for ``optimizer`` if it updates inside backward, else None. Call before ``runner.setup``.

    Raises:
        BackwardStepError: gradient accumulation, a strategy it cannot run under, or FP16.
    """
    kind = _kind(optimizer)
    if kind is None:
        return None
    _check(f"{type(optimizer).__name__} (optim={args.optim!r})", kind, runner, args)
    return BackwardStepper(kind, optimizer, runner, args)


def _check(name: str, kind: str, runner: Any, args: Any) -> None:
    what = f"{name} updates each weight inside backward"
    if args.gradient_accumulation_steps > 1:
        raise BackwardStepError(f"{what}, so gradients cannot accumulate: gradient_accumulation_steps="
                                f"{args.gradient_accumulation_steps} is not supported; set it to 1 (raise "
                                "per_device_train_batch_size for a bigger batch)")
    strategy = runner.strategy
    # Fused under DDP: each gradient is averaged across ranks in the hook, before the update (see setup()).
    whole = strategy.optimizer_parameters == "whole" and not strategy.partitions_parameters
    if not whole or (kind == "layerwise" and runner.world_size > 1):
        where = "one process or DDP" if kind == "fused" else "one process only"
        raise BackwardStepError(
            f"{what}, so it runs on {where} (strategy SingleDevice{', DDP' if kind == 'fused' else ''}), not "
            f"{type(strategy).__name__} with world size {runner.world_size}: "
            + ("a layer-wise optimizer steps each parameter in its gradient hook, before DDP's all-reduce, so "
               "the ranks would drift apart (HF refuses it under DDP too); " if kind == "layerwise" else "")
            + "FSDP, ZeRO and tensor parallel replace or partition the parameters its hooks are on. Train on "
            "one process, or pick another optim (e.g. adamw_torch, galore_adamw)")
    if runner.precision.loss_scaling is not None:
        raise BackwardStepError(f"{what}, bypassing the Runner's step where FP16 unscales and checks for "
                                "overflow: use bf16=True or fp32")


def _average_across_ranks(world_size: int):
    import torch.distributed as dist

    def reduce(grad: torch.Tensor) -> None:
        # As DDP's default hook: divide, then sum, so ranks hold bitwise the same average.
        grad.div_(world_size)
        dist.all_reduce(grad)

    return reduce


class BackwardStepper:
    """Runs the Trainer's backward and end-of-step for an optimizer that updates inside backward.

    Args:
        kind: "fused" (``fused_backward``) or "layerwise" (post-accumulate hooks).
        optimizer: the optimizer.
        runner: the Trainer's Runner.
        args: the TrainingArguments (``max_grad_norm``).
    """

    def __init__(self, kind: str, optimizer: Optimizer, runner: Any, args: Any):
        self.kind, self.optimizer, self.runner = kind, optimizer, runner
        self._max_grad_norm = float(args.max_grad_norm or 0.0)
        self._norm: torch.Tensor | None = None
        self._warned = False

    def setup(self, model: Any) -> None:
        """After ``runner.setup``: under DDP (fused kind) turn DDP's own gradient sync off for good and let the
        optimizer's hooks average each gradient across ranks (one all-reduce per parameter) before using it.
        lomo-optim 0.1.1 does this only on its DeepSpeed ZeRO-3 path; its ordinary path uses local gradients."""
        if self.kind == "fused" and self.runner.world_size > 1:  # replicated weights (checked): DDP
            self.runner.strategy.set_gradient_sync(model, False)  # read by DDP at each forward
            self.optimizer.grad_reducer = _average_across_ranks(self.runner.world_size)

    @property
    def uses_runner_backward(self) -> bool:
        """Whether backward goes through the Runner (layer-wise) rather than the optimizer's fused_backward."""
        return self.kind == "layerwise"

    @property
    def clips(self) -> bool:
        """Whether the fused optimizer clips the total gradient norm (its ``clip_grad_norm``)."""
        clip = getattr(self.optimizer, "clip_grad_norm", None)
        return self.kind == "fused" and clip is not None and clip > 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one step's loss (already scaled as the Runner's backward would take it)."""
        if self.kind == "layerwise":
            self.runner.backward(loss)
            return
        lr = float(self.optimizer.param_groups[0]["lr"])  # the scheduler's rate for this step
        try:
            self._norm = self.optimizer.grad_norm(loss) if self.clips else None
            self.optimizer.fused_backward(loss, lr)
        except RuntimeError as err:
            # The package measures the norm in a first backward that keeps the graph for the second one.
            if not self.clips or ("retain_graph" not in str(err) and "second time" not in str(err)):
                raise
            raise BackwardStepError(
                f"{type(self.optimizer).__name__} clips the gradient norm (max_grad_norm={self._max_grad_norm}) by "
                "measuring it in a first backward that keeps the graph for the updating one, and this model's loss "
                "cannot run backward twice over one graph. Set max_grad_norm=0 to train without clipping, or use "
                "a loss that can (shardkit's Llama: LlamaConfig(fused=False))") from err

    def finish_step(self, scheduler: Any) -> torch.Tensor | None:
        """End of an optimizer step: step the schedule (``scheduler``, None for none or one stepped on
        metrics), count the step; returns the gradient norm when one was measured."""
        if self.kind == "layerwise":
            if self._max_grad_norm > 0 and not self._warned:
                self._warned = True
                logger.warning("max_grad_norm=%s is not applied with a layer-wise optimizer: each parameter "
                               "steps as its gradient lands, before a total norm exists", self._max_grad_norm)
            self.runner.step()
            return None
        self.optimizer.step()  # a no-op; tells torch's scheduler the optimizer stepped before it
        self.runner.record_step(scheduler)  # the Runner counts the step and steps the schedule
        return self._norm
