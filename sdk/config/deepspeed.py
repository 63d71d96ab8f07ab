"""DeepSpeed JSON configs as they are: every key checked, "auto" settled, mapped onto shardkit's objects.

    resolved = resolve_deepspeed("ds_config.json", gradient_accumulation_steps=4)
    resolved.strategy, resolved.precision   # ZeRO3(offload_optimizer="cpu", ...), BF16()

zero_optimization.stage maps 0 -> DDP (SingleDevice on one process), 1 -> ZeRO1, 2 -> ZeRO2, 3 -> ZeRO3,
and stage 3 with both offloads on NVMe -> ZeROInfinity. Unlike DeepSpeed, an unknown key is an error.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardkit.config.common import (
    AUTO,
    ConfigError,
    ConfigMismatchError,
    ResolvedConfig,
    load_mapping,
    precision_kind,
    reconcile,
    warn_once,
    world_size_from_env,
)
from shardkit.config.deepspeed_schema import walk
from shardkit.config.monitors import trackers_from_deepspeed
from shardkit.config.optim import resolve_optimizer, resolve_scheduler
from shardkit.utils.dtypes import dtype_name
from shardkit.utils.suggest import did_you_mean

if TYPE_CHECKING:
    from shardkit.strategies.activation_checkpointing import ActivationCheckpointing

__all__ = ["StrategySpec", "activation_checkpointing_from_section", "build_strategy", "check_nvme_path",
           "known_top_level_keys", "precision_from_deepspeed", "resolve_deepspeed", "strategy_spec_from_deepspeed"]

log = logging.getLogger("shardkit.config")

StrategySpec = tuple[str, dict[str, Any]]  # ("ZeRO3", {"offload_optimizer": "cpu", ...})

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_RUNNER = "Runner({}=...)"
# DeepSpeed keys with nothing to act on here -> why (warned once each, by name, when set).
_AC_NO_EFFECT = {
    "partition_activations": "it splits checkpoints across DeepSpeed model-parallel ranks (an mpu), which "
                             "shardkit's engines do not have; under TensorParallel use sequence_parallel=True, "
                             "which shards the activations between blocks",
    "contiguous_memory_optimization": "it copies partitioned checkpoints into one DeepSpeed buffer "
                                      "(partition_activations only)",
    "number_checkpoints": "it sizes contiguous_memory_optimization's buffer; the blocks checkpointed are the "
                          "model's repeated blocks",
    "profile": "it times deepspeed.checkpointing.checkpoint calls only; use torch.profiler for the blocks",
}


def build_strategy(spec: StrategySpec) -> Any:
    """Instantiate a strategy from its spec (class or registry name; imports the engine's module only now)."""
    from shardkit.strategies.registry import STRATEGIES

    name, kwargs = spec
    return STRATEGIES.build(name, **kwargs)


def resolve_deepspeed(
    config: str | os.PathLike | Mapping[str, Any], *, strategy: Any = None, precision: Any = None,
    gradient_accumulation_steps: int | None = None, micro_batch_size: int | None = None,
    max_grad_norm: float | None = None, world_size: int | None = None,
    optimizer_params: Mapping[str, Any] | None = None, scheduler_params: Mapping[str, Any] | None = None,
    source: str | None = None, runner_names: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Turn a DeepSpeed config (path or dict) into strategy + precision + Runner settings.

    Args:
        config: a DeepSpeed JSON path or its dict.
        strategy, precision, gradient_accumulation_steps, micro_batch_size, max_grad_norm: the Runner's
            explicit values (None = not given). They fill the file's "auto" values; an explicit file value
            that disagrees raises ConfigMismatchError naming both.
        world_size: data-parallel processes, for the train_batch_size check (default: WORLD_SIZE, else 1).
        optimizer_params, scheduler_params: values that fill "auto" optimizer/scheduler params (lr, betas,
            eps, weight_decay; warmup_num_steps, total_num_steps, ...).
        source: how errors name the config (default: the path, or "the DeepSpeed config dict").
        runner_names: how errors name where each Runner value came from (default "Runner(<name>=...)").

    Raises:
        ConfigKeyError: unknown key (dotted path and the closest valid key).
        ConfigMismatchError: file and Runner disagree.
        ConfigError: an impossible value or combination (stage/offload, batch sizes, nvme_path).
        NotImplementedError: a key that changes training and that shardkit cannot honour.
    """
    if isinstance(config, Mapping):
        raw, where = copy.deepcopy(dict(config)), source or "the DeepSpeed config dict"
    else:
        raw, where = load_mapping(config), source or str(config)
    names = {k: _RUNNER.format(k) for k in ("strategy", "precision", "gradient_accumulation_steps",
                                            "micro_batch_size", "max_grad_norm")}
    names.update(runner_names or {})
    found = walk(raw, where)
    world = world_size or world_size_from_env() or 1
    resolved_precision = precision_from_deepspeed(raw, where, precision, names["precision"])
    resolved_strategy = _strategy(raw, where, strategy, names["strategy"], world)
    accumulation, micro = _batch_sizes(raw, where, gradient_accumulation_steps, micro_batch_size, world, names)
    clip = reconcile("gradient_clipping", raw.get("gradient_clipping"), where, max_grad_norm, names["max_grad_norm"])
    optimizer = resolve_optimizer(raw.get("optimizer"), where, optimizer_params)
    lr = (optimizer or {}).get("params", {}).get("lr")
    scheduler = resolve_scheduler(raw.get("scheduler"), where, scheduler_params, lr)
    if found["ignore"]:
        log.debug("%s: accepted and not acted on: %s", where, ", ".join(found["ignore"]))
    return ResolvedConfig(
        strategy=resolved_strategy, precision=resolved_precision, gradient_accumulation_steps=accumulation,
        micro_batch_size=micro, max_grad_norm=_as_float(clip, "gradient_clipping", where) or None,
        optimizer=optimizer, scheduler=scheduler, source=where, ignored_keys=tuple(found["ignore"]),
        activation_checkpointing=_activation_checkpointing(raw, where), trackers=trackers_from_deepspeed(raw, where),
    )


def _activation_checkpointing(raw: Mapping[str, Any], where: str) -> ActivationCheckpointing | None:
    section = raw.get("activation_checkpointing")
    return None if section is None else activation_checkpointing_from_section(section, where)


def activation_checkpointing_from_section(section: Mapping[str, Any], where: str) -> ActivationCheckpointing:
    """:class:`~shardkit.strategies.ActivationCheckpointing` for a DeepSpeed config's ``activation_checkpointing``
    section (its keys already checked by the schema).

    The section turns checkpointing of the repeated blocks on. ``cpu_checkpointing`` offloads the saved block
    inputs to host memory and ``synchronize_checkpoint_boundary`` synchronises around each block, as in
    DeepSpeed; ``partition_activations``, ``contiguous_memory_optimization``, ``number_checkpoints`` and
    ``profile`` have nothing to act on here: each warns once, by name, when set.
    """
    from shardkit.strategies.activation_checkpointing import ActivationCheckpointing

    for key in ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                "synchronize_checkpoint_boundary", "profile"):
        if not isinstance(section.get(key, False), bool):
            raise ConfigError(f"activation_checkpointing.{key}={section[key]!r} in {where} must be true or false")
    for key, why in _AC_NO_EFFECT.items():
        if section.get(key) not in (None, False):
            warn_once(f"deepspeed:activation_checkpointing.{key}",
                      f"{where}: activation_checkpointing.{key}={section[key]!r} has no effect on shardkit's "
                      f"checkpointing: {why}. It is still handed to deepspeed.checkpointing for a model that "
                      "calls deepspeed.checkpointing.checkpoint itself")
    if section.get("contiguous_memory_optimization") and not (
            section.get("partition_activations") and section.get("number_checkpoints")):
        raise ConfigError(f"activation_checkpointing.contiguous_memory_optimization=true in {where} needs "
                          "partition_activations=true and number_checkpoints (DeepSpeed's own rule); turn it off")
    return ActivationCheckpointing(blocks=True, offload_to_cpu=bool(section.get("cpu_checkpointing", False)),
                                   synchronize=bool(section.get("synchronize_checkpoint_boundary", False)),
                                   deepspeed=dict(section))


# ---- precision -------------------------------------------------------------------------------------


def _flag(raw: Mapping[str, Any], name: str, where: str) -> bool | None:
    section = raw.get(name) if name in raw else raw.get("bfloat16") if name == "bf16" else None
    if section is None:
        return None
    value = section.get("enabled", False)
    if value == AUTO:
        return None
    if not isinstance(value, bool):
        raise ConfigError(f"{name}.enabled={value!r} in {where} must be true, false or 'auto'")
    return value


def precision_from_deepspeed(raw: Mapping[str, Any], where: str, precision: Any = None,
                             precision_where: str = "Runner(precision=...)") -> Any:
    """The Precision the fp16/bf16 sections and communication_data_type ask for, checked against ``precision``."""
    from shardkit.precision.base import parse_dtype
    from shardkit.precision.registry import PRECISIONS

    fp16, bf16 = _flag(raw, "fp16", where), _flag(raw, "bf16", where)
    if fp16 and bf16:
        raise ConfigError(f"fp16.enabled and bf16.enabled are both true in {where}; enable one")
    stated = "fp16" if fp16 else "bf16" if bf16 else "fp32" if (fp16 is False or bf16 is False) else None
    comm = raw.get("communication_data_type")
    comm_dtype = parse_dtype(comm, "communication_data_type") if comm is not None else None
    knobs = {k: v for k, v in (raw.get("fp16") or {}).items() if k in ("loss_scale", "initial_scale_power",
                                                                       "loss_scale_window", "hysteresis",
                                                                       "min_loss_scale")}
    if precision is not None:
        kind = precision_kind(precision)
        # fp16 false with bf16 open says only "not fp16"; one stated switch is enough to disagree.
        if (stated is not None and stated != kind and not (stated == "fp32" and _not_excluded(kind, fp16, bf16))):
            raise ConfigMismatchError(f"precision: {stated} in {where} (fp16.enabled={fp16}, bf16.enabled={bf16}) "
                                      f"but {precision!r} from {precision_where}; set it in one place")
        if kind == "fp16":
            for key, value in knobs.items():
                reconcile(f"fp16.{key}", value, where, getattr(precision, key), f"{precision_where} ({precision!r})")
        if comm_dtype is not None:
            reconcile("communication_data_type", comm, where, dtype_name(precision.comm_dtype),
                      f"{precision_where} ({precision!r})")
        return precision
    extra = {"comm_dtype": comm_dtype} if comm_dtype is not None else {}
    if stated == "fp16":
        extra.update({k: _number(v, f"fp16.{k}", where) for k, v in knobs.items()})
    return PRECISIONS.build(stated or "fp32", **extra)


def _not_excluded(kind: str, fp16: bool | None, bf16: bool | None) -> bool:
    """True when ``kind`` is compatible with a partial statement such as fp16 false and bf16 open."""
    return {"fp16": fp16 is None, "bf16": bf16 is None, "fp32": True}[kind]


# ---- strategy --------------------------------------------------------------------------------------


def _strategy(raw: Mapping[str, Any], where: str, strategy: Any, strategy_where: str, world: int) -> Any:
    if "zero_optimization" not in raw:
        if strategy is not None:
            return strategy
        return build_strategy(("DDP", {}) if world > 1 else ("SingleDevice", {}))
    spec = strategy_spec_from_deepspeed(raw, where, world)
    if strategy is not None:
        stage = raw["zero_optimization"].get("stage", 0)
        raise ConfigMismatchError(f"strategy: {spec[0]} (zero_optimization.stage={stage}) in {where} but "
                                  f"{type(strategy).__name__} from {strategy_where}; set it in one place (drop "
                                  f"zero_optimization from the file or the strategy argument)")
    return build_strategy(spec)


def _offload(zero: Mapping[str, Any], name: str, where: str) -> tuple[str, dict[str, Any]]:
    section = zero.get(name) or {}
    device = str(section.get("device", "none") or "none").lower()
    if device not in _OFFLOAD_DEVICES:
        raise ConfigError(f"zero_optimization.{name}.device={section.get('device')!r} in {where} is not a device"
                          f"{did_you_mean(device, _OFFLOAD_DEVICES)}; use one of {list(_OFFLOAD_DEVICES)}")
    if device == "nvme" and not section.get("nvme_path"):
        raise ConfigError(f"zero_optimization.{name}.device='nvme' in {where} needs "
                          f"zero_optimization.{name}.nvme_path (a directory on a fast local disk)")
    return device, dict(section)


def _check_stage_offload(stage: int, opt: str, param: str, where: str) -> None:
    if param != "none" and stage < 3:
        raise ConfigError(f"zero_optimization.offload_param.device={param!r} needs zero_optimization.stage=3 "
                          f"(stage {stage} keeps every parameter on each rank) in {where}; set stage 3 or remove "
                          f"offload_param")
    if opt != "none" and stage < 2:
        raise ConfigError(f"zero_optimization.offload_optimizer.device={opt!r} with stage {stage} in {where}: "
                          f"shardkit offloads optimizer state from ZeRO stage 2 on (ZeRO1 keeps it on the device); "
                          f"set stage 2 or 3")
    if opt == "nvme" and stage < 3:
        raise ConfigError(f"zero_optimization.offload_optimizer.device='nvme' needs stage 3 (ZeRO-Infinity), "
                          f"got stage {stage} in {where}; use device 'cpu' or stage 3")


def _stage(zero: Mapping[str, Any], where: str) -> int:
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage={stage!r} in {where} must be 0, 1, 2 or 3")
    return stage


_COMMON = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
           "overlap_comm": "overlap_comm", "contiguous_gradients": "contiguous_gradients"}
_STAGE3 = {"stage3_prefetch_bucket_size": "prefetch_bucket_size", "prefetch_bucket_size": "prefetch_bucket_size",
           "stage3_param_persistence_threshold": "param_persistence_threshold",
           "param_persistence_threshold": "param_persistence_threshold",
           "stage3_max_live_parameters": "max_live_parameters", "max_live_parameters": "max_live_parameters",
           "stage3_max_reuse_distance": "max_reuse_distance", "max_reuse_distance": "max_reuse_distance",
           "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
           "gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
           "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save"}
_BOOLS = ("overlap_comm", "contiguous_gradients", "gather_16bit_weights_on_model_save")


def strategy_spec_from_deepspeed(raw: Mapping[str, Any], where: str = "the DeepSpeed config",
                                 world_size: int = 1) -> StrategySpec:
    """``(class name, kwargs)`` of the strategy ``zero_optimization`` asks for; no engine is imported."""
    zero = raw.get("zero_optimization") or {}
    stage = _stage(zero, where)
    opt, opt_section = _offload(zero, "offload_optimizer", where)
    param, param_section = _offload(zero, "offload_param", where)
    _check_stage_offload(stage, opt, param, where)
    if stage == 0:
        size = zero.get("reduce_bucket_size")
        kwargs = {"bucket_cap_mb": _number(size, "zero_optimization.reduce_bucket_size", where) * 4 / 2**20} \
            if size not in (None, AUTO) else {}
        return ("DDP", kwargs) if world_size > 1 else ("SingleDevice", {})
    table = {**_COMMON, **(_STAGE3 if stage == 3 else {})}
    kwargs = {}
    for key, arg in table.items():
        if key in zero:
            value = zero[key]
            # Sizes may be written as 0.9 * hidden**2 (fractional); DeepSpeed counts elements, so round.
            kwargs[arg] = value if value == AUTO or arg in _BOOLS else \
                int(round(_number(value, f"zero_optimization.{key}", where)))
    ignored = sorted(set(zero) & set(_STAGE3)) if stage < 3 else []
    if ignored:
        log.debug("%s: %s apply to stage 3 only; ignored at stage %d", where, ", ".join(ignored), stage)
    extra = _extra(raw, zero, opt_section, param_section)
    if stage == 1:
        return "ZeRO1", {**kwargs, **({"extra": extra} if extra else {})}
    if stage == 2:
        return "ZeRO2", {**kwargs, **({"offload_optimizer": opt} if opt != "none" else {}),
                         **({"extra": extra} if extra else {})}
    return _stage3_spec(kwargs, extra, opt, opt_section, param, param_section, raw, zero, where)


def _stage3_spec(kwargs: dict[str, Any], extra: dict[str, Any], opt: str, opt_section: Mapping[str, Any],
                 param: str, param_section: Mapping[str, Any], raw: Mapping[str, Any], zero: Mapping[str, Any],
                 where: str) -> StrategySpec:
    paths = {s.get("nvme_path") for s, d in ((opt_section, opt), (param_section, param)) if d == "nvme"}
    if len(paths) > 1:
        raise ConfigError(f"offload_optimizer.nvme_path and offload_param.nvme_path differ in {where} "
                          f"({sorted(map(str, paths))}); shardkit swaps both to one nvme_path")
    nvme_path = str(next(iter(paths))) if paths else None
    if nvme_path is not None:
        check_nvme_path(nvme_path, where)
    aio = dict(raw.get("aio") or zero.get("aio") or {})
    if opt == "nvme" and param == "nvme":
        args: dict[str, Any] = {"nvme_path": nvme_path, **kwargs}
        for key in ("buffer_count", "buffer_size"):
            if key in param_section:
                args[key] = _integer(param_section[key], f"zero_optimization.offload_param.{key}", where)
        if aio:
            args["aio"] = aio
        return "ZeROInfinity", {**args, **({"extra": extra} if extra else {})}
    args = {**kwargs, **({"offload_optimizer": opt} if opt != "none" else {}),
            **({"offload_params": param} if param != "none" else {}),
            **({"nvme_path": nvme_path} if nvme_path else {})}
    if aio and nvme_path:
        args["aio"] = aio
    return "ZeRO3", {**args, **({"extra": extra} if extra else {})}


def _extra(raw: Mapping[str, Any], zero: Mapping[str, Any], opt_section: Mapping[str, Any],
           param_section: Mapping[str, Any]) -> dict[str, Any]:
    """Raw DeepSpeed keys the ZeRO strategies hand to the engine unchanged (schema kind "pass")."""
    from shardkit.config.deepspeed_schema import OFFLOAD_OPTIMIZER, SCHEMA, ZERO

    top = {k: v for k, v in raw.items() if SCHEMA[k].kind == "pass"}
    zero_extra = {k: v for k, v in zero.items() if ZERO[k].kind == "pass"}
    opt_extra = {k: v for k, v in opt_section.items() if OFFLOAD_OPTIMIZER[k].kind == "pass"}
    if opt_section.get("buffer_count") is not None and opt_section.get("device") == "nvme":
        opt_extra["buffer_count"] = opt_section["buffer_count"]
    param_extra = {} if param_section.get("device") != "nvme" else {
        k: param_section[k] for k in ("buffer_count", "buffer_size", "max_in_cpu") if k in param_section}
    if opt_extra:
        zero_extra["offload_optimizer"] = opt_extra
    if param_extra:
        zero_extra["offload_param"] = param_extra
    return {**top, **({"zero_optimization": zero_extra} if zero_extra else {})}


def check_nvme_path(path: str | os.PathLike, where: str = "the config") -> None:
    """Raise ConfigError unless ``path`` is (or can be created as) a writable directory."""
    target = Path(path)
    probe = target
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"nvme_path {str(target)!r} in {where}: {str(probe)!r} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == target else f"does not exist and {str(probe)!r} is not writable"
        raise ConfigError(f"nvme_path {str(target)!r} in {where} {what} by this user; point nvme_path at a "
                          f"writable directory on a fast local disk")


# ---- batch sizes -----------------------------------------------------------------------------------


def _batch_sizes(raw: Mapping[str, Any], where: str, accumulation: int | None, micro: int | None, world: int,
                 names: Mapping[str, str]) -> tuple[int, int | None]:
    accumulation = reconcile("gradient_accumulation_steps", _opt_int(raw, "gradient_accumulation_steps", where),
                             where, accumulation, names["gradient_accumulation_steps"])
    micro = reconcile("train_micro_batch_size_per_gpu", _opt_int(raw, "train_micro_batch_size_per_gpu", where),
                      where, micro, names["micro_batch_size"])
    total = _opt_int(raw, "train_batch_size", where)
    if total is None or total == AUTO:
        return accumulation or 1, micro
    if micro is not None and accumulation is not None:
        if micro * accumulation * world != total:
            raise ConfigError(f"train_batch_size={total} in {where} != train_micro_batch_size_per_gpu({micro}) * "
                              f"gradient_accumulation_steps({accumulation}) * world_size({world}) = "
                              f"{micro * accumulation * world}; fix one of them (or set train_batch_size 'auto')")
        return accumulation, micro
    if micro is not None:
        known, name = micro, "train_micro_batch_size_per_gpu"
    else:
        known, name = accumulation or 1, "gradient_accumulation_steps"
    if total % (known * world):
        raise ConfigError(f"train_batch_size={total} in {where} is not divisible by {name}({known}) * "
                          f"world_size({world}) = {known * world}")
    other = total // (known * world)
    return (accumulation or 1, other) if micro is None else (other, micro)


def _opt_int(raw: Mapping[str, Any], key: str, where: str) -> Any:
    value = raw.get(key)
    if value is None or value == AUTO:
        return value
    number = _integer(value, key, where)
    if number < 1:
        raise ConfigError(f"{key}={value!r} in {where} must be >= 1")
    return number


def _number(value: Any, key: str, where: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} in {where} must be a number")
    return value


def _integer(value: Any, key: str, where: str) -> int:
    number = _number(value, key, where)
    if float(number) != int(number):
        raise ConfigError(f"{key}={value!r} in {where} must be a whole number")
    return int(number)


def _as_float(value: Any, key: str, where: str) -> float | None:
    return None if value is None else float(_number(value, key, where))


def known_top_level_keys() -> list[str]:
    """Every top-level DeepSpeed key shardkit accepts (for docs and the `config` command)."""
    from shardkit.config.deepspeed_schema import SCHEMA

    return sorted(SCHEMA)

