"""Every DeepSpeed config key shardkit knows, by section, and what shardkit does with it.

Kinds:
    use:         mapped onto shardkit's objects (strategy, precision, Runner settings, optimizer/scheduler).
    pass:        handed unchanged to the DeepSpeed engine by the ZeRO strategies (``extra``); dropped,
                 with a debug line, for strategies that do not run on DeepSpeed.
    ignore:      accepted and not acted on (logging, profiling); listed in a debug log.
    unsupported: changes training in a way shardkit cannot honour; NotImplementedError unless the value
                 is the "off" one (``enabled: false``, ``false``, ``1.0`` ...).

Key names and defaults follow DeepSpeed 0.19's config models (runtime/zero/config.py,
runtime/zero/offload_config.py, runtime/precision_config.py, runtime/constants.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardkit.config.common import AUTO, ConfigError, check_known_keys, check_number, warn_once

__all__ = ["Key", "SCHEMA", "OPTIMIZER_PARAMS", "SCHEDULER_PARAMS", "walk"]


@dataclass(frozen=True)
class Key:
    """What shardkit does with one key (see the module docstring for the kinds)."""

    kind: str
    section: Mapping[str, Key] | None = None
    off: Callable[[Any], bool] | None = None
    why: str = ""
    auto: bool = False
    opaque: bool = False
    aliases: tuple[str, ...] = field(default=())
    number: Mapping[str, Any] | None = None  # check_number's bounds; every numeric key has them
    no_effect: str = ""  # accepted but changes nothing here: warned once, with what to use instead
    nullable: bool = False  # JSON null means "unset" (DeepSpeed's documented default for the key)


def _num(kind: str = "use", auto: bool = False, nullable: bool = False, **bounds: Any) -> Key:
    return Key(kind, auto=auto, number=bounds, nullable=nullable)


POSITIVE_INT = dict(integer=True, minimum=1)
COUNT = dict(integer=True, minimum=0)
SIZE = dict(minimum=0)  # bucket sizes in elements; fractional values are rounded later


def _disabled(value: Any) -> bool:
    if isinstance(value, Mapping):
        return not value.get("enabled", False)
    return not value


def _false(value: Any) -> bool:
    return value is False or value is None or value == 0


USE, PASS, IGNORE = Key("use"), Key("pass"), Key("ignore")
USE_AUTO = Key("use", auto=True)


def _unsupported(why: str, off: Callable[[Any], bool] = _disabled) -> Key:
    return Key("unsupported", off=off, why=why, opaque=True)


def _ignored_section(*keys: str) -> Key:
    return Key("ignore", section={k: IGNORE for k in keys})


OFFLOAD_PARAM = {
    "device": USE, "nvme_path": USE, "buffer_count": _num(**POSITIVE_INT), "buffer_size": _num(above=0),
    "max_in_cpu": _num(**SIZE),
    "pin_memory": Key("ignore", why="shardkit pins memory only where a GPU exists"),
}
OFFLOAD_OPTIMIZER = {
    "device": USE, "nvme_path": USE, "buffer_count": _num(**POSITIVE_INT),
    "pin_memory": Key("ignore", why="shardkit pins memory only where a GPU exists"),
    "pipeline_read": PASS, "pipeline_write": PASS, "pipeline": PASS, "fast_init": PASS,
    "ratio": _num("pass", minimum=0, maximum=1),
    "super_offload": PASS, "cpuadam_cores_perc": PASS,
}
AIO = {"block_size": _num(**POSITIVE_INT), "queue_depth": _num(**POSITIVE_INT),
       "intra_op_parallelism": _num(**POSITIVE_INT), "thread_count": _num(**POSITIVE_INT),
       "single_submit": USE, "overlap_events": USE, "use_gds": USE}

ZERO = {
    "stage": _num(integer=True, minimum=0, maximum=3), "contiguous_gradients": USE,
    "reduce_bucket_size": _num(auto=True, above=0), "allgather_bucket_size": _num(above=0),
    "overlap_comm": USE, "offload_param": Key("use", section=OFFLOAD_PARAM),
    "offload_optimizer": Key("use", section=OFFLOAD_OPTIMIZER),
    # DeepSpeed reads aio at the top level; some configs nest it here, so both places are accepted.
    "aio": Key("use", section=AIO),
    "stage3_prefetch_bucket_size": _num(auto=True, **SIZE), "prefetch_bucket_size": _num(auto=True, **SIZE),
    "stage3_param_persistence_threshold": _num(auto=True, **SIZE),
    "param_persistence_threshold": _num(auto=True, **SIZE),
    "stage3_max_live_parameters": _num(**SIZE), "max_live_parameters": _num(**SIZE),
    "stage3_max_reuse_distance": _num(**SIZE), "max_reuse_distance": _num(**SIZE),
    "stage3_gather_16bit_weights_on_model_save": USE, "gather_16bit_weights_on_model_save": USE,
    "stage3_gather_fp16_weights_on_model_save": USE,
    "reduce_scatter": PASS, "use_multi_rank_bucket_allreduce": PASS, "allgather_partitions": PASS,
    "compute_grad_norm": PASS, "load_from_fp32_weights": PASS, "elastic_checkpoint": PASS,
    "sub_group_size": _num("pass", above=0),
    "stage3_model_persistence_threshold": _num("pass", **SIZE),
    "stage3_module_granularity_threshold": _num("pass", **SIZE),
    "stage3_use_all_reduce_for_fetch_params": PASS, "stage3_allgather_sequential": PASS,
    "ignore_unused_parameters": PASS, "legacy_stage1": PASS, "round_robin_gradients": PASS,
    "parameter_alignment": PASS,
    "zero_hpz_partition_size": _num("pass", **POSITIVE_INT), "zero_quantized_weights": PASS,
    "zero_quantized_nontrainable_weights": PASS, "zero_quantized_gradients": PASS, "memory_efficient_linear": PASS,
    "pipeline_loading_checkpoint": PASS, "override_module_apply": PASS, "enable_sanity_checks": PASS,
    "mics_shard_size": _num("pass", integer=True, minimum=-1), "mics_hierarchical_params_gather": PASS,
    "leaf_module": PASS,
    "save_muon_momentum_buffer_in_memory": PASS, "log_trace_cache_warnings": IGNORE,
    "cpu_offload": _unsupported("deprecated; use zero_optimization.offload_optimizer.device", _false),
    "cpu_offload_param": _unsupported("deprecated; use zero_optimization.offload_param.device", _false),
    "cpu_offload_use_pin_memory": IGNORE,
    "zenflow": _unsupported("ZenFlow's stale-gradient updates are not supported", _disabled),
}

FP16 = {
    "enabled": USE_AUTO, "loss_scale": _num(minimum=0),  # 0: dynamic scaling
    # 2**initial_scale_power must stay finite in fp32 (2**127 is the largest power of two).
    "initial_scale_power": _num(integer=True, minimum=0, maximum=127),
    "loss_scale_window": _num(**POSITIVE_INT), "hysteresis": _num(**POSITIVE_INT), "min_loss_scale": _num(above=0),
    "auto_cast": _unsupported("fp16.auto_cast (casting inputs to fp16) is not supported; shardkit autocasts "
                              "the forward", _false),
    "consecutive_hysteresis": _unsupported("consecutive_hysteresis is not supported by shardkit's loss scaler",
                                           _false),
    "fp16_master_weights_and_grads": _unsupported("fp16 master weights are not supported", _false),
}
BF16 = {
    "enabled": USE_AUTO, "immediate_grad_update": PASS, "check_grad_overflow": PASS,
    "bf16_master_weights_and_grads": _unsupported("bf16 master weights: use BF16(mode='true')", _false),
    "bf16_optimizer_states": _unsupported("bf16 optimizer states are not supported", _false),
}

SCHEMA: dict[str, Key] = {
    "train_batch_size": _num(auto=True, **POSITIVE_INT),
    "train_micro_batch_size_per_gpu": _num(auto=True, **POSITIVE_INT),
    "gradient_accumulation_steps": _num(auto=True, **POSITIVE_INT),
    # A negative clip norm reverses the gradients (a run's loss rose from 4.65 to 26.9 in 30 steps); 0: no clipping.
    "gradient_clipping": _num(auto=True, minimum=0), "communication_data_type": USE,
    "optimizer": Key("use", section={"type": USE, "params": Key("use", opaque=True), "legacy_fusion": IGNORE}),
    "scheduler": Key("use", section={"type": USE, "params": Key("use", opaque=True)}),
    "fp16": Key("use", section=FP16), "bf16": Key("use", section=BF16), "bfloat16": Key("use", section=BF16),
    "zero_optimization": Key("use", section=ZERO), "aio": Key("use", section=AIO),
    "zero_allow_untested_optimizer": PASS, "zero_force_ds_cpu_optimizer": PASS,
    # Checkpointing of the repeated blocks under every strategy, and deepspeed.checkpointing's options
    # (config.deepspeed.activation_checkpointing_from_section warns by name for the keys with nothing to act on).
    "activation_checkpointing": Key("use", section={
        **{k: USE for k in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                            "synchronize_checkpoint_boundary", "profile")},
        # DeepSpeed's documented section writes "number_checkpoints": null (unset).
        "number_checkpoints": _num("use", nullable=True, **POSITIVE_INT)}),
    "data_types": Key("pass", section={"grad_accum_dtype": PASS}),
    "steps_per_print": _num("ignore", **POSITIVE_INT),
    "wall_clock_breakdown": IGNORE, "dump_state": IGNORE, "memory_breakdown": IGNORE,
    "dataloader_drop_last": IGNORE, "seq_parallel_communication_data_type": IGNORE, "disable_allgather": IGNORE,
    "use_data_before_expert_parallelism": IGNORE, "gradient_allreduce_op": IGNORE,
    "checkpoint": Key("ignore", section={
        **{k: IGNORE for k in ("tag_validation", "load_universal", "parallel_write", "writer")},
        "use_node_local_storage": Key("ignore", no_effect=(
            "checkpoint.use_node_local_storage has no effect: shardkit checkpoints are written by Runner.save to one "
            "directory every rank reaches; give Runner.save a node-local path only on a single machine"))}),
    # DeepSpeed's monitors: trackers of shardkit.observability.trackers that the Runner writes to (config/monitors.py).
    "tensorboard": Key("use", section={k: USE for k in ("enabled", "output_path", "job_name")}),
    "csv_monitor": Key("use", section={k: USE for k in ("enabled", "output_path", "job_name")}),
    "wandb": Key("use", section={k: USE for k in ("enabled", "group", "team", "project")}),
    "comet": _ignored_section("enabled", "samples_log_interval", "project", "workspace", "api_key",
                              "experiment_name", "experiment_key", "online", "mode"),
    "flops_profiler": _ignored_section("enabled", "recompute_fwd_factor", "profile_step", "module_depth",
                                       "top_modules", "detailed", "output_file"),
    "comms_logger": _ignored_section("enabled", "verbose", "prof_all", "debug", "prof_ops"),
    "timers": Key("ignore", opaque=True), "autotuning": Key("ignore", opaque=True),
    "nebula": Key("ignore", opaque=True),
    "amp": _unsupported("apex AMP is not supported; use the fp16 or bf16 section"),
    "torch_autocast": _unsupported("torch_autocast: use the fp16/bf16 sections (shardkit autocasts from them)"),
    "prescale_gradients": _unsupported("prescale_gradients is not supported (gradients are averaged after the "
                                       "reduction)", _false),
    "gradient_predivide_factor": _unsupported("gradient_predivide_factor other than 1.0 is not supported",
                                              lambda v: v in (None, 1, 1.0)),
    "sparse_gradients": _unsupported("sparse gradients are not supported", _false),
    "pipeline": _unsupported("pipeline parallelism is not part of shardkit", lambda v: not v),
    "sparse_attention": _unsupported("DeepSpeed sparse attention is not supported", lambda v: not v),
    "progressive_layer_drop": _unsupported("progressive layer drop is not supported"),
    "curriculum_learning": _unsupported("curriculum learning is not supported"),
    "data_efficiency": _unsupported("DeepSpeed data efficiency is not supported"),
    "compression_training": _unsupported("compression training is not supported", lambda v: not v),
    "quantize_training": _unsupported("quantize_training is not supported"),
    "weight_quantization": _unsupported("weight quantization is not supported", lambda v: not v),
    "eigenvalue": _unsupported("eigenvalue computation is not supported"),
    "elasticity": _unsupported("elastic batch sizes are not supported"),
    "hybrid_engine": _unsupported("the DeepSpeed hybrid engine is not supported"),
    "compile": _unsupported("DeepSpeed's compile section is not supported; call torch.compile yourself"),
    "tensor_parallel": _unsupported("DeepSpeed AutoTP: use shardkit.strategies.TensorParallel(tp_size=...)",
                                    lambda v: not v or int(v.get("autotp_size", 1) or 1) <= 1),
    "sequence_parallel_size": _unsupported("DeepSpeed sequence parallelism is not supported",
                                           lambda v: v in (None, 1)),
}

OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "torch_adam", "adam_w_mode",
              "fused"),
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "torch_adam", "adam_w_mode",
             "fused"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value"),
}
UNSUPPORTED_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb", "lamb", "lion", "muadam", "muadamw", "musgd",
                          "muon")

_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": (*_WARMUP, "total_num_steps"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size",
                 "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size", "cycle_momentum",
                 "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "last_batch_iteration"),
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase", "last_batch_iteration"),
}


def walk(config: Mapping[str, Any], source: str, schema: Mapping[str, Key] = SCHEMA, path: str = "",
         found: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Check every key of ``config`` against ``schema``; return ``{"ignore": [...], "pass": [...]}`` dotted keys.

    Raises:
        ConfigKeyError: an unknown key (every one of them, each with the closest valid key).
        ConfigError: "auto" where nothing can fill it in, or a section that is not a mapping.
        NotImplementedError: a key that changes training and that shardkit cannot honour.
    """
    found = found if found is not None else {"ignore": [], "pass": []}
    check_known_keys(config, schema, path, source)
    for name, value in config.items():
        key, dotted = schema[name], f"{path}.{name}" if path else name
        if key.kind == "unsupported":
            if not (key.off or _disabled)(value):
                raise NotImplementedError(f"{dotted}={value!r} in {source}: {key.why}. Remove the key (or turn it "
                                          f"off) to train with shardkit.")
            found["ignore"].append(dotted)
            continue
        if key.no_effect and value not in (None, False, {}):
            warn_once(f"deepspeed:{dotted}", f"{source}: {key.no_effect}")
        if value == AUTO and not key.auto:
            raise ConfigError(f"{dotted}: 'auto' is not accepted here in {source}; write a value (only batch sizes, "
                              f"accumulation, clipping, precision switches, bucket sizes and optimizer/scheduler "
                              f"params may be 'auto')")
        if key.number is not None and value != AUTO and not (value is None and key.nullable):
            check_number(value, dotted, source, **key.number)
        if key.kind in ("ignore", "pass"):
            found[key.kind].append(dotted)
        if key.section is not None and not key.opaque:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{dotted} in {source} must be a section (a mapping), not {value!r}")
            walk(value, source, key.section, dotted, found)
    return found
