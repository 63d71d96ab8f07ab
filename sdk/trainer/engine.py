"""The Trainer's Runner, optimizer and schedule, from TrainingArguments (HF spellings) or explicit objects."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.runner import Runner
from shardkit.trainer.arguments import TrainingArguments
from shardkit.trainer.schedulers import get_scheduler

__all__ = ["EngineSpec", "build_runner", "create_optimizer", "create_scheduler", "decay_parameter_names"]



@dataclass
class EngineSpec:
    """What the DeepSpeed config asked for beyond strategy and precision (optimizer/scheduler sections)."""

    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None


def _precision_from_args(args: TrainingArguments, precision: Any) -> Any:
    from shardkit.precision import BF16, FP16, FP32

    flags = [name for name in ("fp16", "bf16") if getattr(args, name)]
    if precision is not None:
        if flags:
            raise ValueError(f"Trainer(precision={precision!r}) and TrainingArguments {flags[0]}=True: "
                             "give one of them")
        return precision
    if args.fp16:
        return FP16()
    if args.bf16:
        return BF16()
    if args.tf32:
        return FP32(tf32=True)
    return None


def _fsdp_strategy(args: TrainingArguments, strategy: Any) -> Any:
    if strategy is not None:
        raise ValueError(f"Trainer(strategy={strategy!r}) and TrainingArguments.fsdp={args.fsdp!r}: give one of them")
    from shardkit.config.fsdp import trainer_fsdp_spec
    from shardkit.strategies.fsdp import FSDP

    _, kwargs = trainer_fsdp_spec(args.fsdp, args.fsdp_config)  # every key honoured or refused by name
    return FSDP(**kwargs)


def build_runner(args: TrainingArguments, strategy: Any, precision: Any, max_steps: int | None,
                 warmup_steps: int | None) -> tuple[Runner, EngineSpec]:
    """A Runner for ``args``: ``deepspeed=`` (its "auto" values filled from ``args``), ``fsdp=``, or the objects.

    The Runner's seed is the data seed (it orders the data); the RNGs are seeded with ``args.seed`` after.
    """
    from shardkit.seeding import seed_everything

    precision = _precision_from_args(args, precision)
    data_seed = args.data_seed if args.data_seed is not None else args.seed
    spec = EngineSpec()
    common = dict(gradient_accumulation_steps=args.gradient_accumulation_steps, seed=data_seed)
    if args.deepspeed:
        from shardkit.config import resolve_runner_config

        resolved = resolve_runner_config(
            args.deepspeed, strategy=strategy, precision=precision,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            micro_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm or None,
            optimizer_params={"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2],
                              "eps": args.adam_epsilon, "weight_decay": args.weight_decay},
            scheduler_params=_ds_scheduler_values(args, max_steps, warmup_steps, _ds_scheduler_type(args.deepspeed)),
        )
        spec = EngineSpec(resolved.optimizer, resolved.scheduler)
        runner = Runner(resolved.strategy, resolved.precision,
                        activation_checkpointing=resolved.activation_checkpointing, **common)
    else:
        if args.fsdp:
            strategy = _fsdp_strategy(args, strategy)
        runner = Runner(strategy, precision, **common)
    seed_everything(args.seed)
    return runner, spec


def _ds_scheduler_type(config: Any) -> str | None:
    if isinstance(config, dict):
        raw = config
    else:
        import json

        try:
            raw = json.loads(Path(config).read_text())
        except (OSError, ValueError):
            return None  # resolve_runner_config reports the unreadable file with its own message
    section = raw.get("scheduler") if isinstance(raw, dict) else None
    return section.get("type") if isinstance(section, dict) else None


def _ds_scheduler_values(args: TrainingArguments, max_steps: int | None, warmup: int | None,
                         kind: str | None) -> dict[str, Any]:
    """Values for the DeepSpeed scheduler's "auto" params, only those its type takes (others are refused)."""
    from shardkit.config.deepspeed_schema import SCHEDULER_PARAMS

    values: dict[str, Any] = {"warmup_max_lr": args.learning_rate, "warmup_min_lr": 0.0}
    if warmup is not None:
        values["warmup_num_steps"] = warmup
    if max_steps is not None:
        values["total_num_steps"] = max_steps
    known = SCHEDULER_PARAMS.get(kind or "", ())
    return {k: v for k, v in values.items() if k in known}


def estimate_world_size() -> int:
    """Data-parallel ranks before the Runner exists (the launcher's WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Parameters that get weight decay: not biases, not norm weights (any 1-d weight), not embeddings' norms."""
    names = set()
    for name, param in model.named_parameters():
        if param.ndim >= 2 and not name.endswith("bias"):
            names.add(name)
    return names


def create_optimizer(model: nn.Module, args: TrainingArguments, spec: EngineSpec) -> torch.optim.Optimizer:
    """The optimizer ``args.optim`` names (or the DeepSpeed config's), weight decay only on >= 2-d weights."""
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not args.weight_decay and spec.optimizer is None:
        # Without weight decay the two groups are the same: one group is the same maths and lighter to save.
        groups = [{"params": [p for _, p in params], "weight_decay": 0.0}]
    if spec.optimizer is not None:
        from shardkit.config.optim import build_optimizer

        ds_params = dict(spec.optimizer["params"])
        for group in groups:
            group["weight_decay"] = ds_params.get("weight_decay", 0.0) if group["weight_decay"] else 0.0
        return build_optimizer(spec.optimizer, groups)
    from shardkit.optim import create_optimizer as by_name

    kwargs = {"lr": args.learning_rate}
    if "adam" in args.optim:
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    kwargs.update(args.optim_args)  # optim_args win over the TrainingArguments they repeat (e.g. betas)
    context = {"model": model, "training_args": args, "optim_target_modules": args.optim_target_modules}
    return by_name(args.optim, groups, context=context, **kwargs)


def create_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, spec: EngineSpec,
                     max_steps: int) -> Any:
    """``lr_scheduler_type`` with warmup (or the DeepSpeed config's scheduler section)."""
    if spec.scheduler is not None:
        from shardkit.config.optim import build_scheduler

        return build_scheduler(spec.scheduler, optimizer)
    kwargs = dict(args.lr_scheduler_kwargs)
    if args.lr_scheduler_type == "reduce_lr_on_plateau":
        kwargs.setdefault("mode", "max" if args.greater_is_better else "min")
    return get_scheduler(args.lr_scheduler_type, optimizer, args.get_warmup_steps(max_steps), max_steps, kwargs)


def steps_per_epoch(batches_per_epoch: int, accumulation: int) -> int:
    """Optimizer steps in one epoch: whole accumulation windows only (see Trainer's note on the tail)."""
    return max(batches_per_epoch // accumulation, 1)


def total_steps(args: TrainingArguments, per_epoch: int | None) -> tuple[int, int]:
    """(max_steps, number of epochs) from max_steps or num_train_epochs."""
    if args.fast_dev_run:
        return int(args.fast_dev_run), 1
    if args.max_steps > 0:
        epochs = math.ceil(args.max_steps / per_epoch) if per_epoch else 1
        return args.max_steps, max(epochs, 1)
    if per_epoch is None:
        raise ValueError("the train dataset has no length: set TrainingArguments.max_steps")
    return math.ceil(args.num_train_epochs * per_epoch), math.ceil(args.num_train_epochs)
