"""What some named optimizers need from the Trainer beyond ``step()``, under every strategy.

* Schedule-free (``schedule_free_adamw/sgd/radam``): gradients are taken at a point y, but the weights
  to evaluate and keep are the average x. ``optimizer.train()`` swaps y in and ``optimizer.eval()``
  swaps x in; the Trainer calls :func:`to_train` before each training step and :func:`to_eval` before
  evaluation, before every save (checkpoint and ``save_model``) and at the end of training.

  Under DeepSpeed (ZeRO-1/2/3) the optimizer steps DeepSpeed's fp32 master partitions, not the model's
  parameters: the swap changes the masters only, and the model (its 16-bit copies, or under ZeRO-3 its
  partitioned ``ds_tensor``\\ s) keeps y until the next step copies the masters over (and under ZeRO-3 the
  optimizer's param groups are even empty between steps, so the swap reaches nothing at all). That is why
  Hugging Face's integration evaluates and exports y under DeepSpeed. Here the ZeRO strategy follows every
  swap with the copy DeepSpeed's own step makes (masters -> model parameters, gathered), in a user's own
  loop as in the Trainer, so eval, save and export see x, and training resumes from y.
* GrokAdamW: reads ``param_group["train_loss"]`` (and ``"eval_loss"``) for its grokking signal; the
  Trainer sets them (:func:`pass_training_loss`, :func:`pass_eval_loss`).
* :func:`check_optimizer_strategy`: the combinations that cannot work are refused at setup, by name.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from shardkit.optim.named import OptimizerUnsupportedError, is_galore, is_grokadamw, is_schedule_free

logger = logging.getLogger("shardkit.trainer")

__all__ = ["check_optimizer_strategy", "pass_eval_loss", "pass_training_loss", "to_eval", "to_train"]


def _optimizer(trainer: Any) -> Any:
    prepared = getattr(trainer, "prepared", None)  # a Trainer once set up with the Runner
    return getattr(trainer, "optimizer", None) if getattr(prepared, "done", False) else None


def _swap(trainer: Any, train: bool) -> None:
    optimizer = _optimizer(trainer)
    if optimizer is None or not is_schedule_free(optimizer):
        return
    if all(bool(g["train_mode"]) == train for g in optimizer.param_groups):
        return
    # Under ZeRO the strategy made these switches reach the model (ZeROStrategy._follow_mode_switches).
    optimizer.train() if train else optimizer.eval()


def to_train(trainer: Any) -> None:
    """Schedule-free: put the point gradients are taken at (y) in the weights; no-op for other optimizers."""
    _swap(trainer, True)


def to_eval(trainer: Any) -> None:
    """Schedule-free: put the averaged weights (x) in the model, under every strategy; no-op otherwise."""
    _swap(trainer, False)


def pass_training_loss(trainer: Any, window_loss: torch.Tensor) -> None:
    """GrokAdamW: set the window's training loss (over all ranks) where its step reads it."""
    optimizer = _optimizer(trainer)
    if optimizer is None or not is_grokadamw(optimizer):
        return
    # A copy: the all-reduce below is in place, and window_loss is also the step's logged loss.
    loss = window_loss.detach().float().reshape(1).to(trainer.runner.device, copy=True)
    if trainer.runner.world_size > 1:  # every rank must step with the same signal
        if trainer.args.average_tokens_across_devices:
            loss = trainer.runner.all_reduce(loss, "sum")
        else:
            loss = trainer.runner.all_reduce(loss, "mean") / trainer.args.gradient_accumulation_steps
    for group in optimizer.param_groups:
        group["train_loss"] = float(loss.item())


def pass_eval_loss(trainer: Any, metrics: dict[str, float]) -> None:
    """GrokAdamW: the latest eval loss, the other half of its default grokking signal."""
    optimizer = _optimizer(trainer)
    value = next((v for k, v in metrics.items() if k.endswith("_loss")), None)
    if optimizer is None or value is None or not is_grokadamw(optimizer):
        return
    for group in optimizer.param_groups:
        group["eval_loss"] = float(value)


def check_optimizer_strategy(optimizer: Any, strategy: Any) -> None:
    """Refuse, before setup, an optimizer the strategy cannot run (the message names both and the fix).

    GaLore projects each 2-d weight's gradient with an SVD of the whole matrix. ZeRO (every stage) hands
    the optimizer one flat 1-d fp32 partition per param group, so there is no matrix to project; FSDP
    and TensorParallel hand it shards (DTensors), whose projections are not the whole matrix's. Single
    device and DDP keep whole weights. GrokAdamW reads each parameter's position and clips each parameter
    by itself: under ZeRO's flat partitions it would be another optimizer, so it is refused there too.
    """
    if optimizer is None:
        return
    name = type(strategy).__name__
    layout = strategy.optimizer_parameters  # what the strategy hands the optimizer
    flat = layout == "flat"  # the ZeRO engines: one 1-d partition per param group
    if flat and is_grokadamw(optimizer):
        raise OptimizerUnsupportedError(f"GrokAdamW cannot run under {name}: its step decays beta1 by each "
                                        "parameter's position and clips each parameter's gradient by itself, and "
                                        "ZeRO hands it one flat partition per param group instead of the parameters "
                                        "(it would run a different optimizer). Use GrokAdamW with SingleDevice, DDP "
                                        "or FSDP")
    sharded = layout == "shards"  # FSDP, TensorParallel: DTensor shards
    _check_dtensor_steps(optimizer, name, sharded)
    if flat and isinstance(optimizer, torch.optim.Adafactor):
        logger.warning("adafactor under %s: ZeRO hands the optimizer 1-d flat partitions, so Adafactor keeps an "
                       "unfactored second moment (one value per element, as for 1-d parameters) instead of row "
                       "and column factors: it trains and resumes, but with more state than under DDP", name)
    if not is_galore(optimizer):
        return
    if flat or sharded:
        how = "flattens each param group into one 1-d partition" if flat else "shards each weight into blocks"
        raise OptimizerUnsupportedError(f"GaLore ({type(optimizer).__name__}) cannot run under {name}: it {how}, "
                                        "and GaLore needs each target weight whole as a 2-d matrix. Use GaLore "
                                        "with SingleDevice or DDP, or another optimizer under this strategy")


def _check_dtensor_steps(optimizer: Any, name: str, sharded: bool) -> None:
    """Optimizers whose step cannot take FSDP/TP's DTensor parameters: each was run on DTensor shards and failed
    in torch's operators, so it is refused before the first step instead of failing inside it."""
    if not sharded:
        return
    if isinstance(optimizer, torch.optim.Adafactor):
        raise OptimizerUnsupportedError(f"adafactor (torch.optim.Adafactor) cannot run under {name}: its step's "
                                        "in-place norm ops are not supported on DTensor shards (torch raises on "
                                        "aten.pow_ with a partial placement). Use adamw_torch_fused or sgd here")
