"""The Trainer's Runner, optimizer and schedule, from TrainingArguments (HF spellings) or explicit objects."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardkit.runner.core import Runner
from shardkit.trainer.arguments import TrainingArguments
from shardkit.trainer.schedulers import get_scheduler

__all__ = ["DeepSpeedSections", "build_runner", "create_optimizer", "create_scheduler", "decay_parameter_names",
           "enable_full_determinism", "estimate_steps", "optimizer_param_groups", "steps_per_epoch", "total_steps"]


@dataclass
class DeepSpeedSections:
    """The DeepSpeed config's optimizer and scheduler sections (resolved): what it asked for beyond strategy and
    precision, which the Trainer builds its optimizer and schedule from. Both None without a DeepSpeed config."""

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
    launched = _launcher_precision()
    if launched is not None:
        return launched
    if args.tf32:
        return FP32(tf32=True)
    return None


def _launcher_precision() -> Any:
    """``accelerate launch``'s ``mixed_precision`` (``ACCELERATE_MIXED_PRECISION``), which transformers'
    TrainingArguments take when neither fp16 nor bf16 is set; None when absent or "no", and under ``shardkit launch``
    (the Runner reads the YAML itself)."""
    from shardkit.config.common import CONFIG_FILE_ENV
    from shardkit.precision.registry import PRECISIONS

    name = os.environ.get("ACCELERATE_MIXED_PRECISION", "").strip().lower()
    if os.environ.get(CONFIG_FILE_ENV) is not None or name in ("", "no"):
        return None
    if name not in ("fp16", "bf16"):
        raise ValueError(f"ACCELERATE_MIXED_PRECISION={name!r} (set by accelerate launch from mixed_precision): "
                         f"shardkit's Trainer trains in 'no', 'fp16' or 'bf16'; fix mixed_precision in the config")
    return PRECISIONS.build(name)


def _launched_engine(args: TrainingArguments, strategy: Any, precision: Any) -> tuple[Any, Any, str | None]:
    """(strategy, DeepSpeed config, its name) after ``accelerate launch``'s FSDP/DeepSpeed variables, read as
    transformers' Trainer reads them: with neither ``fsdp`` nor ``deepspeed`` in the arguments the launcher's engine
    is used (an explicit ``strategy`` must be of its class); arguments asking for the same engine win (transformers
    builds its plugin from them), with a warning when they differ; arguments asking for the other engine are refused
    (transformers refuses ``--fsdp`` under the launcher's DeepSpeed, and would train DeepSpeed, not the launcher's
    FSDP, for ``--deepspeed``)."""
    from shardkit.config.accelerate_env import from_accelerate_launch, reconcile_strategy
    from shardkit.config.common import warn_once
    from shardkit.precision import BF16, FP16

    mixed = "bf16" if isinstance(precision, BF16) else "fp16" if isinstance(precision, FP16) else "no"
    launched = from_accelerate_launch(mixed)
    if launched is None:
        return strategy, None, None
    given = "fsdp" if args.fsdp else "deepspeed" if args.deepspeed else None
    if given is not None and (launched.kind == "FSDP") != (given == "fsdp"):
        raise ValueError(f"{launched.source} asks for {launched.kind} but TrainingArguments.{given}="
                         f"{getattr(args, given)!r} asks for {'FSDP' if given == 'fsdp' else 'DeepSpeed'}: one job "
                         f"trains with one engine; launch with the config that matches the arguments, or drop "
                         f"--{given} to train as launched")
    if given == "fsdp":
        return reconcile_strategy(launched, _fsdp_strategy(args, strategy), "TrainingArguments.fsdp"), None, None
    if given == "deepspeed":
        warn_once(f"launch-env-deepspeed:{launched.source}", f"TrainingArguments.deepspeed is used; the DeepSpeed "
                  f"settings of {launched.source} are not (the arguments win, as in transformers)")
        return strategy, None, None
    if launched.kind == "DEEPSPEED" and strategy is None:
        return None, launched.deepspeed, launched.source
    return reconcile_strategy(launched, strategy, "Trainer(strategy=...)"), None, None


def _fsdp_strategy(args: TrainingArguments, strategy: Any) -> Any:
    if strategy is not None:
        raise ValueError(f"Trainer(strategy={strategy!r}) and TrainingArguments.fsdp={args.fsdp!r}: give one of them")
    from shardkit.strategies.fsdp import FSDP
    from shardkit.trainer.fsdp_config import fsdp_strategy_kwargs

    return FSDP(**fsdp_strategy_kwargs(args))


def _default_strategy(args: TrainingArguments, strategy: Any) -> Any:
    """``use_cpu=True`` on one process: the CPU even where a GPU is; under a launcher DDP with the ``ddp_*``
    settings; an explicit strategy as given (the ``ddp_*`` settings then must not be set)."""
    ddp = {k: v for k, v in (("find_unused_parameters", args.ddp_find_unused_parameters),
                             ("bucket_cap_mb", args.ddp_bucket_cap_mb), ("static_graph", args.ddp_static_graph))
           if v is not None}
    if args.ddp_broadcast_buffers is False:
        raise ValueError("ddp_broadcast_buffers=False: shardkit's DDP keeps torch's default (buffers broadcast from "
                         "rank 0 each forward); drop the setting")
    if strategy is not None:
        if ddp:
            raise ValueError(f"Trainer(strategy={strategy!r}) and TrainingArguments ddp_* settings {sorted(ddp)}: set "
                             "them on the strategy (DDP(find_unused_parameters=..., bucket_cap_mb=...))")
        return strategy
    world = estimate_world_size()
    if world == 1:
        if args.use_cpu:
            from shardkit.strategies.single import SingleDevice

            return SingleDevice("cpu")
        return None
    if ddp or args.ddp_timeout != 1800:
        from shardkit.strategies.ddp import DDP

        return DDP(timeout=float(args.ddp_timeout), **ddp)
    return None


def build_runner(args: TrainingArguments, strategy: Any, precision: Any, max_steps: int | None,
                 warmup_steps: int | None) -> tuple[Runner, DeepSpeedSections]:
    """A Runner for ``args``: ``deepspeed=`` (its "auto" values filled from ``args``), ``fsdp=``, or the objects.

    The Runner's seed is the data seed (it orders the data); the RNGs are seeded with ``args.seed`` after.
    """
    from shardkit.config.accelerate_env import launcher_read
    from shardkit.utils.seeding import seed_everything

    precision = _precision_from_args(args, precision)
    launched_strategy, launched_deepspeed, source = _launched_engine(args, strategy, precision)
    data_seed = args.data_seed if args.data_seed is not None else args.seed
    sections = DeepSpeedSections()
    common = dict(gradient_accumulation_steps=args.gradient_accumulation_steps, seed=data_seed,
                  logging_dir=args.logging_dir, profile_steps=args.profile_steps, peak_tflops=args.peak_tflops)
    deepspeed = args.deepspeed or launched_deepspeed
    if deepspeed:
        from shardkit.config import resolve_runner_config

        resolved = resolve_runner_config(
            deepspeed, source=source, strategy=strategy, precision=precision,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            micro_batch_size=args.per_device_train_batch_size, max_grad_norm=args.max_grad_norm or None,
            optimizer_params={"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2],
                              "eps": args.adam_epsilon, "weight_decay": args.weight_decay},
            scheduler_params=_ds_scheduler_values(args, max_steps, warmup_steps, _ds_scheduler_type(deepspeed)),
        )
        sections = DeepSpeedSections(resolved.optimizer, resolved.scheduler)
        with launcher_read():
            runner = Runner(resolved.strategy, resolved.precision,
                            activation_checkpointing=resolved.activation_checkpointing,
                            log_with=list(resolved.trackers) or None, **common)  # DeepSpeed's monitor sections
    else:
        if launched_strategy is not strategy:  # the launcher's engine, or the arguments' FSDP reconciled with it
            strategy = launched_strategy
        elif args.fsdp:
            strategy = _fsdp_strategy(args, strategy)
        else:
            strategy = _default_strategy(args, strategy)
        with launcher_read():
            runner = Runner(strategy, precision, **common)
    seed_everything(args.seed)
    if args.full_determinism:
        enable_full_determinism()
    return runner, sections


def _ds_scheduler_type(config: Any) -> str | None:
    if isinstance(config, dict):
        raw = config
    else:
        from shardkit.config.common import ConfigError, load_mapping

        try:
            raw = load_mapping(config)
        except ConfigError:
            return None  # resolve_runner_config reports the unreadable file with its own message
    section = raw.get("scheduler")
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


def enable_full_determinism() -> None:
    """``full_determinism=True``: deterministic kernels only (torch errors on an op that has none), cuDNN without
    autotuning, and the cuBLAS workspace setting deterministic matmuls need (as Hugging Face sets them)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def estimate_world_size() -> int:
    """Data-parallel ranks before the Runner exists (the launcher's WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Parameters that get weight decay, by Hugging Face's rule: not in a LayerNorm, not a bias, not a norm."""
    from shardkit.trainer.hf_checkpoint import hf_decay_parameter_names

    return hf_decay_parameter_names(model)


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Hugging Face's two groups (with and without weight decay) of the trainable parameters; an empty one is
    left out."""
    decay = decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def create_optimizer(model: nn.Module, args: TrainingArguments, sections: DeepSpeedSections,
                     cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None) -> torch.optim.Optimizer:
    """The optimizer ``args.optim`` names (or ``optimizer_cls_and_kwargs``, or the DeepSpeed config's)."""
    if cls_and_kwargs is not None:
        cls, kwargs = cls_and_kwargs
        # NOTE: the kwargs' weight_decay is the decay group's (Hugging Face's groups would override it with
        # args.weight_decay, 0 by default, silently turning the decay the user asked for off).
        decay = kwargs.get("weight_decay", args.weight_decay)
        return cls(optimizer_param_groups(model, decay), **dict(kwargs))
    groups = optimizer_param_groups(model, args.weight_decay)
    if not args.weight_decay and str(args.optim).startswith("schedule_free") and len(groups) > 1:
        # NOTE: schedule-free counts its steps per param group, and ZeRO-3 steps the inner optimizer once per
        # group (the other groups empty), so two groups there would count every step twice and average
        # other weights than under DDP (measured: eval loss 4.53 against 4.42). Without weight decay the two
        # groups are the same maths: one group keeps the count right under every strategy.
        groups = [{"params": [p for g in groups for p in g["params"]], "weight_decay": 0.0}]
    if sections.optimizer is not None:
        from shardkit.config.optim import build_optimizer

        ds_params = dict(sections.optimizer["params"])
        for group in groups:
            group["weight_decay"] = ds_params.get("weight_decay", 0.0) if group["weight_decay"] else 0.0
        return build_optimizer(sections.optimizer, groups)
    from shardkit.optim import create_optimizer as by_name

    kwargs = {"lr": args.learning_rate}
    if "adam" in args.optim:
        kwargs.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    kwargs.update(args.optim_args)  # optim_args win over the TrainingArguments they repeat (e.g. betas)
    context = {"model": model, "training_args": args, "optim_target_modules": args.optim_target_modules}
    return by_name(args.optim, groups, context=context, **kwargs)


def create_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArguments, sections: DeepSpeedSections,
                     max_steps: int) -> Any:
    """``lr_scheduler_type`` with warmup (or the DeepSpeed config's scheduler section)."""
    if sections.scheduler is not None:
        from shardkit.config.optim import build_scheduler

        return build_scheduler(sections.scheduler, optimizer)
    kwargs = dict(args.lr_scheduler_kwargs)
    if args.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy"):
        kwargs.setdefault("mode", "max" if args.greater_is_better else "min")
    return get_scheduler(args.lr_scheduler_type, optimizer, args.get_warmup_steps(max_steps), max_steps, kwargs)


def steps_per_epoch(batches_per_epoch: int, accumulation: int) -> int:
    """Optimizer steps in one epoch, as Hugging Face counts them: a last, shorter window steps too, and an epoch
    shorter than one window still takes one step."""
    return max(math.ceil(batches_per_epoch / accumulation), 1)


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


def estimate_steps(args: TrainingArguments, train_dataset: Any) -> tuple[int | None, int | None]:
    """(max steps, warmup steps) before the Runner exists, for a DeepSpeed config's "auto" total_num_steps and
    warmup: from the dataset's length and the launcher's world size (max_steps alone for a stream)."""
    try:
        samples = math.ceil(len(train_dataset) / estimate_world_size())
    except TypeError:
        return (args.max_steps if args.max_steps > 0 else None), None
    batch = args.per_device_train_batch_size
    batches = samples // batch if args.dataloader_drop_last else math.ceil(samples / batch)
    max_steps, _ = total_steps(args, steps_per_epoch(batches, args.gradient_accumulation_steps))
    return max_steps, args.get_warmup_steps(max_steps)
