"""The checks TrainingArguments runs when built: keywords, types and ranges, choices, and combinations.

Every value a user or a file gives is checked where it arrives, with an error naming the field, the value and
the fix (Hugging Face's Trainer accepts ``learning_rate=nan``, ``adam_beta1=1.5`` or
``gradient_accumulation_steps=2.5`` and fails, or trains on nonsense, much later). Normalisation follows
transformers 5: ``output_dir=None`` is ``"trainer_output"``, ``report_to=None``/``"none"`` is ``[]``, enum
fields take the enum or its value in any case, ``include_num_input_tokens_seen=True`` is ``"all"``.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import warnings
from typing import Any

from shardkit.trainer.argument_errors import (
    LOG_LEVELS,
    OBSOLETE_ARGUMENTS,
    TrainingArgumentsError,
    UnknownArgumentError,
)
from shardkit.trainer.enums import DebugOption, HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType, coerce
from shardkit.trainer.fsdp_config import read_fsdp_config_file
from shardkit.utils.operations import json_object
from shardkit.utils.suggest import did_you_mean

__all__ = ["OBSOLETE_ARGUMENTS", "check_arguments", "translate_keywords"]

logger = logging.getLogger("shardkit.trainer")

_DICT_FIELDS = ("lr_scheduler_kwargs", "accelerator_config", "fsdp_config", "deepspeed", "liger_kernel_config",
                "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")


def translate_keywords(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse keywords ``cls`` does not take, naming the closest field or what replaced an obsolete name."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in kwargs:
        if key in known:
            continue
        if key in OBSOLETE_ARGUMENTS:
            raise UnknownArgumentError(f"{cls.__name__}({key}=...): {OBSOLETE_ARGUMENTS[key]}")
        raise UnknownArgumentError(f"{cls.__name__} got an unknown argument {key!r}{did_you_mean(key, known)} "
                                   "(every field is listed in the README's Trainer table)")
    return kwargs


def check_arguments(args: Any) -> None:
    """Normalise and check every field of ``args`` (called by ``TrainingArguments.__post_init__``)."""
    _normalise(args)
    _check_choices(args)
    _check_numbers(args)
    _check_steps(args)
    _check_eval_and_save(args)
    _check_precision_and_engines(args)
    _check_dataloader(args)
    _check_accelerate_settings(args)
    _check_extensions(args)


# ---- normalisation ----------------------------------------------------------------------------------


def _normalise(args: Any) -> None:
    if args.output_dir is None:
        args.output_dir = "trainer_output"
    args.output_dir = os.path.expanduser(str(args.output_dir))
    for name in _DICT_FIELDS:
        value = getattr(args, name)
        if isinstance(value, str) and value.lstrip().startswith("{"):
            setattr(args, name, json_object(value, f"TrainingArguments.{name}", error=TrainingArgumentsError))
    if args.lr_scheduler_kwargs is None:
        args.lr_scheduler_kwargs = {}
    from shardkit.strategies.activation_checkpointing import parse_checkpoint_kwargs

    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):  # checked under the name given
        if getattr(args, name) is not None:
            setattr(args, name, parse_checkpoint_kwargs(getattr(args, name), f"TrainingArguments.{name}"))
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if getattr(args, new) is None and getattr(args, old) is not None:
            warnings.warn(f"TrainingArguments.{old} is deprecated (as in transformers 5): use {new}", FutureWarning,
                          stacklevel=4)
            setattr(args, new, getattr(args, old))
        setattr(args, old, getattr(args, new))  # the old name mirrors the new one for code that reads it
    if args.activation_checkpointing is None:
        args.activation_checkpointing = args.gradient_checkpointing = False
    if args.disable_tqdm is None:
        from shardkit.trainer.trainer_logging import trainer_log_level

        args.disable_tqdm = trainer_log_level() > logging.WARNING
    tokens = args.include_num_input_tokens_seen
    if isinstance(tokens, str) and tokens.lower() in ("true", "false", "1", "0"):  # from a command line
        tokens = tokens.lower() in ("true", "1")
    if isinstance(tokens, bool):
        args.include_num_input_tokens_seen = "all" if tokens else "no"
    if args.run_name is None:
        args.run_name = args.output_dir
    if args.logging_dir is None:
        args.logging_dir = os.path.join(args.output_dir, "runs")
    if args.use_cpu:
        args.dataloader_pin_memory = False
    if args.fsdp is None or args.fsdp is False:
        args.fsdp = ""
    elif args.fsdp is True:
        args.fsdp = "full_shard"
    elif isinstance(args.fsdp, (list, tuple)):
        args.fsdp = " ".join(str(o) for o in args.fsdp)


# ---- choices -----------------------------------------------------------------------------------------


def _check_choices(args: Any) -> None:
    args.eval_strategy = coerce(IntervalStrategy, "eval_strategy", args.eval_strategy)
    args.logging_strategy = coerce(IntervalStrategy, "logging_strategy", args.logging_strategy)
    args.save_strategy = coerce(SaveStrategy, "save_strategy", args.save_strategy)
    args.hub_strategy = coerce(HubStrategy, "hub_strategy", args.hub_strategy)
    args.lr_scheduler_type = coerce(SchedulerType, "lr_scheduler_type", args.lr_scheduler_type)
    for name in ("log_level", "log_level_replica"):
        value = str(getattr(args, name)).lower()
        if value not in LOG_LEVELS:
            raise TrainingArgumentsError(f"TrainingArguments.{name}={getattr(args, name)!r} is not valid"
                                         f"{did_you_mean(value, LOG_LEVELS)} Use one of {list(LOG_LEVELS)}")
        setattr(args, name, value)
    debug = args.debug
    if debug is None or debug == "":
        debug = []
    elif isinstance(debug, str):
        debug = debug.split()
    args.debug = [coerce(DebugOption, "debug", d) for d in debug]
    if args.include_num_input_tokens_seen not in ("no", "all", "non_padding"):
        raise TrainingArgumentsError(f"TrainingArguments.include_num_input_tokens_seen="
                                     f"{args.include_num_input_tokens_seen!r} must be True/False, 'all', "
                                     "'non_padding' or 'no'")
    _check_report_to(args)
    _check_optim(args)


def _check_report_to(args: Any) -> None:
    from shardkit.trainer.reporting import available_reporters, reporter_names

    value = args.report_to
    if value is None or value == "none" or value == ["none"]:
        args.report_to = []
        return
    names = [value] if isinstance(value, str) else list(value)
    if "all" in names:
        args.report_to = available_reporters()
        return
    known = reporter_names()
    for name in names:
        if name not in known:
            raise TrainingArgumentsError(f"TrainingArguments.report_to={name!r}: no reporter of that name"
                                         f"{did_you_mean(str(name), known)} (reporters: {sorted(known)}; register "
                                         "another with shardkit.trainer.reporting.register_reporter)")
    args.report_to = [n for n in names if n != "none"]


def _check_optim(args: Any) -> None:
    from shardkit.trainer.hf_optimizers import HF_ONLY_OPTIMIZERS, optimizer_names

    name = str(args.optim).strip().lower().replace("-", "_") if args.optim is not None else ""
    names = optimizer_names()
    if name in names:
        args.optim = name
        return
    if name in HF_ONLY_OPTIMIZERS:
        raise TrainingArgumentsError(f"TrainingArguments.optim={args.optim!r}: {HF_ONLY_OPTIMIZERS[name]}")
    raise TrainingArgumentsError(f"TrainingArguments.optim={args.optim!r} is not an optimizer shardkit has"
                                 f"{did_you_mean(name, names)} Use one of {names}")


# ---- numbers -----------------------------------------------------------------------------------------


def _number(args: Any, name: str, *, integer: bool = False, low: float | None = None, low_open: bool = False,
            high: float | None = None, high_open: bool = False, optional: bool = False, finite: bool = True) -> None:
    """``args.<name>`` must be a (finite) number in the range; ints stay ints, integral floats become ints."""
    value = getattr(args, name)
    if value is None and optional:
        return
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        shown = value if isinstance(value, (str, int, float)) else f"a {type(value).__name__}"
        raise TrainingArgumentsError(f"TrainingArguments.{name}={shown!r} must be {kind}"
                                     + (" or None" if optional else ""))
    if math.isnan(value) or (finite and math.isinf(value)):
        raise TrainingArgumentsError(f"TrainingArguments.{name}={value} must be a finite number")
    if integer:
        if value != int(value):
            raise TrainingArgumentsError(f"TrainingArguments.{name}={value} must be a whole number (micro-batches, "
                                         "workers and steps are counted in ones)")
        value = int(value)
        setattr(args, name, value)
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        where = f"in {lo}, {hi}" if lo and hi else (f"> {low}" if low_open else f">= {low}") if lo else \
            (f"< {high}" if high_open else f"<= {high}")
        raise TrainingArgumentsError(f"TrainingArguments.{name}={value} must be {where}")


def _check_numbers(args: Any) -> None:
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        _number(args, name, integer=True, low=1)
    _number(args, "eval_accumulation_steps", integer=True, low=1, optional=True)
    _number(args, "learning_rate", low=0)
    _number(args, "weight_decay", low=0)
    _number(args, "adam_beta1", low=0, high=1, high_open=True)
    _number(args, "adam_beta2", low=0, high=1, high_open=True)
    _number(args, "adam_epsilon", low=0)
    _number(args, "max_grad_norm", finite=False)  # <= 0 turns clipping off; inf measures the norm unclipped
    _number(args, "num_train_epochs", low=0)
    _number(args, "max_steps", integer=True)
    _number(args, "warmup_steps", low=0)
    _number(args, "label_smoothing_factor", low=0, high=1, high_open=True)
    _number(args, "dataloader_num_workers", integer=True, low=0)
    _number(args, "dataloader_prefetch_factor", integer=True, low=1, optional=True)
    _number(args, "max_time", low=0, low_open=True, optional=True)
    _number(args, "seed", integer=True, low=0, high=2**32, high_open=True)
    _number(args, "data_seed", integer=True, low=0, high=2**32, high_open=True, optional=True)
    _number(args, "save_total_limit", integer=True, low=1, optional=True)
    _number(args, "eval_delay", low=0)
    _number(args, "ddp_timeout", integer=True, low=1)
    _number(args, "fast_dev_run", integer=True, low=0)
    if args.torch_empty_cache_steps is not None and (
            isinstance(args.torch_empty_cache_steps, bool) or not isinstance(args.torch_empty_cache_steps, int)
            or args.torch_empty_cache_steps < 1):
        raise TrainingArgumentsError(f"TrainingArguments.torch_empty_cache_steps={args.torch_empty_cache_steps!r} "
                                     "must be an integer bigger than 0 (or None to never empty the cache)")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise TrainingArgumentsError(f"max_steps={args.max_steps} and num_train_epochs={args.num_train_epochs}: set "
                                     "max_steps > 0 or num_train_epochs > 0")


def _check_steps(args: Any) -> None:
    for name in ("logging_steps", "save_steps", "eval_steps"):
        _number(args, name, low=0, optional=name == "eval_steps")
    if args.eval_strategy == IntervalStrategy.STEPS and args.eval_steps is None:
        if args.logging_steps <= 0:
            raise TrainingArgumentsError("eval_strategy='steps' needs eval_steps (it defaults to logging_steps, "
                                         f"which is {args.logging_steps}): set eval_steps")
        args.eval_steps = args.logging_steps
    for name, strategy in (("logging_steps", args.logging_strategy), ("save_steps", args.save_strategy),
                           ("eval_steps", args.eval_strategy)):
        value = getattr(args, name)
        if strategy != "steps" or value is None:
            continue
        if value == 0:
            raise TrainingArgumentsError(f"TrainingArguments.{name}=0 with the 'steps' strategy: set a step count "
                                         "(or a ratio < 1 of the training steps)")
        if value > 1 and value != int(value):
            raise TrainingArgumentsError(f"TrainingArguments.{name}={value}: above 1 it is a step count and must "
                                         "be an integer (below 1, a ratio of the training steps)")
        if value > 1:
            setattr(args, name, int(value))


# ---- combinations ------------------------------------------------------------------------------------


def _check_eval_and_save(args: Any) -> None:
    if args.eval_strategy != IntervalStrategy.NO:
        args.do_eval = True
    if args.load_best_model_at_end and args.metric_for_best_model is None:
        args.metric_for_best_model = "loss"
    if args.save_strategy == SaveStrategy.BEST and args.metric_for_best_model is None:
        raise TrainingArgumentsError("save_strategy='best' needs a metric: `args.metric_for_best_model` must be "
                                     "provided (e.g. 'loss' or 'accuracy')")
    if args.load_best_model_at_end:
        _check_best_model(args)
    for kind in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY):
        if args.lr_scheduler_type == kind and args.eval_strategy == IntervalStrategy.NO:
            raise TrainingArgumentsError(f"lr_scheduler_type={kind.value!r} steps on an eval metric: set "
                                         "eval_strategy to 'steps' or 'epoch'")
    if args.metric_for_best_model is None and args.lr_scheduler_type in (SchedulerType.REDUCE_ON_PLATEAU,
                                                                         SchedulerType.GREEDY):
        args.metric_for_best_model = "loss"
    if args.metric_for_best_model is not None and args.greater_is_better is None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")


def _check_best_model(args: Any) -> None:
    if args.eval_strategy == IntervalStrategy.NO:
        raise TrainingArgumentsError("load_best_model_at_end=True needs evaluations: set eval_strategy to 'steps' "
                                     "or 'epoch' (the same as save_strategy)")
    if args.save_strategy == SaveStrategy.BEST:
        return
    if args.save_strategy != args.eval_strategy:
        raise TrainingArgumentsError(f"load_best_model_at_end=True needs save_strategy ({args.save_strategy.value!r})"
                                     f" to match eval_strategy ({args.eval_strategy.value!r}) or be 'best': set "
                                     f"save_strategy={args.eval_strategy.value!r}")
    if args.save_strategy != SaveStrategy.STEPS:
        return
    eval_steps, save_steps = args.eval_steps, args.save_steps
    if (eval_steps < 1) != (save_steps < 1):
        raise TrainingArgumentsError(f"save_steps={save_steps} and eval_steps={eval_steps} must both be step counts "
                                     "or both ratios when load_best_model_at_end=True")
    if eval_steps >= 1 and int(save_steps) % int(eval_steps):
        raise TrainingArgumentsError(f"load_best_model_at_end=True needs save_steps ({int(save_steps)}) to be a "
                                     f"multiple of eval_steps ({int(eval_steps)}), so every save has an evaluation:"
                                     f" set save_steps={int(eval_steps) * max(1, round(save_steps / eval_steps))}")
    if eval_steps < 1 and round(save_steps * 1_000_000) % round(eval_steps * 1_000_000):
        raise TrainingArgumentsError(f"save_steps={save_steps} must be a multiple of eval_steps={eval_steps}")


def _check_precision_and_engines(args: Any) -> None:
    if args.fp16 and args.bf16:
        raise TrainingArgumentsError("fp16=True and bf16=True: choose one mixed precision")
    if args.fp16_full_eval and args.bf16_full_eval:
        raise TrainingArgumentsError("fp16_full_eval=True and bf16_full_eval=True: choose one evaluation dtype")
    if args.fsdp and args.deepspeed:
        raise TrainingArgumentsError("fsdp and deepspeed are both set: choose one engine (drop fsdp= or deepspeed=)")
    valid = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard", "offload", "auto_wrap")
    for option in str(args.fsdp).split():
        if option not in valid:
            raise TrainingArgumentsError(f"TrainingArguments.fsdp option {option!r} is not valid"
                                         f"{did_you_mean(option, valid)} Use any of {list(valid)}")
    if isinstance(args.fsdp_config, str):

        args.fsdp_config = read_fsdp_config_file(args.fsdp_config)


def _check_dataloader(args: Any) -> None:
    if args.dataloader_prefetch_factor is not None and args.dataloader_num_workers == 0:
        raise TrainingArgumentsError(f"dataloader_prefetch_factor={args.dataloader_prefetch_factor} needs worker "
                                     "processes: set dataloader_num_workers > 0, or drop dataloader_prefetch_factor")
    if args.train_sampling_strategy not in ("random", "sequential", "group_by_length"):
        raise TrainingArgumentsError(f"TrainingArguments.train_sampling_strategy={args.train_sampling_strategy!r}"
                                     " must be 'random', 'sequential' or 'group_by_length'")
    if args.include_for_metrics and not set(args.include_for_metrics) <= {"inputs", "loss"}:
        raise TrainingArgumentsError(f"TrainingArguments.include_for_metrics={args.include_for_metrics!r}: the "
                                     "entries are 'inputs' and 'loss'")
    if args.label_names is not None and (isinstance(args.label_names, str)
                                         or not all(isinstance(n, str) for n in args.label_names)):
        raise TrainingArgumentsError(f"TrainingArguments.label_names={args.label_names!r} must be a list of names")


_ACCELERATOR_DEFAULTS = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                         "use_seedable_sampler": True, "non_blocking": False, "gradient_accumulation_kwargs": None,
                         "use_configured_state": False}


def _check_accelerate_settings(args: Any) -> None:
    config = args.accelerator_config
    if config is not None and not hasattr(config, "items"):
        config = dataclasses_asdict(config)
    for key, value in dict(config or {}).items():
        if key not in _ACCELERATOR_DEFAULTS:
            raise TrainingArgumentsError(f"TrainingArguments.accelerator_config has no key {key!r}"
                                         f"{did_you_mean(str(key), _ACCELERATOR_DEFAULTS)}")
        if value != _ACCELERATOR_DEFAULTS[key]:
            raise TrainingArgumentsError(f"TrainingArguments.accelerator_config[{key!r}]={value!r}: shardkit's Trainer "
                                         "has no Accelerate object; its Runner shards each batch per rank and seeds "
                                         "the order itself. Drop the key")
    if args.parallelism_config is not None:
        raise TrainingArgumentsError("TrainingArguments.parallelism_config: pass the strategy to the Trainer instead "
                                     "(Trainer(strategy=TensorParallel(tp_size=...)) or FSDP(...))")
    if DebugOption.TPU_METRICS_DEBUG in args.debug:
        raise TrainingArgumentsError("debug='tpu_metrics_debug': shardkit does not run on TPUs; drop it")
    if args.ddp_backend is not None and args.ddp_backend not in ("gloo", "nccl"):
        raise TrainingArgumentsError(f"TrainingArguments.ddp_backend={args.ddp_backend!r}: shardkit runs gloo (CPU) "
                                     "and nccl (GPU), chosen by the device; drop it or use one of those")


def dataclasses_asdict(value: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(vars(value))


def _check_extensions(args: Any) -> None:
    from shardkit.optim.named import parse_optim_args
    from shardkit.trainer.model_prep import check_model_prep_args

    args.optim_args = parse_optim_args(args.optim_args)  # JSON or HF's "rank=64,scale=0.25"
    targets = args.optim_target_modules
    if not isinstance(targets, (str, list, tuple, type(None))) or (
            isinstance(targets, (list, tuple)) and not all(isinstance(t, str) for t in targets)):
        raise TrainingArgumentsError(f"TrainingArguments.optim_target_modules={targets!r} must be a list of module "
                                     "names, a regex string or 'all-linear'")
    check_model_prep_args(args)  # neftune, fused kernels and torch_compile fields
    peak = args.peak_tflops
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or not 0 < peak < math.inf):
        raise TrainingArgumentsError(f"TrainingArguments.peak_tflops={peak!r} must be a positive number of TFLOP/s "
                                     "per device (e.g. 989 for an H100 in bf16), or None for the default")
    if args.profile_steps is not None:  # a bad range is named now, not when the Runner is built
        from shardkit.observability import parse_profile_steps

        try:
            parse_profile_steps(args.profile_steps)
        except ValueError as err:
            raise TrainingArgumentsError(f"TrainingArguments.{err}") from None
