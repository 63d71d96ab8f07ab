"""Accelerate-style YAML configs: launch settings plus the strategy and precision they ask for.

    shardkit launch --config_file fsdp.yaml train.py     # launch_args_from_yaml(path) -> process counts
    Runner()                                              # inside train.py: reads SHARDKIT_CONFIG_FILE

Every key is checked (unknown ones fail with the closest valid key). Unlike Accelerate, nothing falls
back to another strategy: a file that asks for FSDP runs FSDP, or fails saying why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.config.common import (
    CONFIG_FILE_ENV,
    ConfigError,
    ConfigMismatchError,
    ConfigResourceError,
    ResolvedConfig,
    check_known_keys,
    check_number,
    load_mapping,
    precision_kind,
    reconcile,
    warn_once,
    world_size_from_env,
)
from shardkit.config.deepspeed import StrategySpec, build_strategy, resolve_deepspeed
from shardkit.config.fsdp_options import fsdp_spec
from shardkit.strategies.registry import is_registered_as
from shardkit.utils.suggest import did_you_mean

__all__ = ["AccelerateConfig", "CONFIG_FILE_ENV", "check_resources", "deepspeed_config_from_section",
           "fsdp_strategy_from_section", "launch_args_from_yaml", "load_accelerate_config", "resolve_accelerate"]

log = logging.getLogger("shardkit.config")

_IGNORED = ("same_network", "main_training_function", "enable_cpu_affinity", "downcast_bf16", "tpu_name",
            "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_env", "command_file", "commands")
TOP_KEYS = ("compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
            "num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend", "gpu_ids",
            "fsdp_config", "deepspeed_config", "tp_config", "dynamo_config", "dynamo_backend", "megatron_lm_config",
            "ipex_config", "mpirun_config", "fp8_config", "parallelism_config", *_IGNORED)
DEEPSPEED_KEYS = ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
                  "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps",
                  "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher",
                  "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
                  "deepspeed_moe_layer_cls_names")
TP_KEYS = ("tp_size",)
DYNAMO_KEYS = ("dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
               "dynamo_use_regional_compilation")

DATA_PARALLEL = ("MULTI_CPU", "MULTI_GPU")
DISTRIBUTED_TYPES = ("NO", *DATA_PARALLEL, "FSDP", "DEEPSPEED", "TP")
_OTHER_TYPES = {"MULTI_NPU": "Ascend NPUs", "MULTI_MLU": "Cambricon MLUs", "MULTI_MUSA": "Moore Threads GPUs",
                "MULTI_XPU": "Intel XPUs", "MULTI_HPU": "Gaudi HPUs", "MULTI_SDAA": "SDAA devices",
                "XLA": "TPUs (XLA)", "TPU": "TPUs (XLA)", "MEGATRON_LM": "Megatron-LM"}
_MIXED = ("no", "fp16", "bf16")
MULTINODE_LAUNCHERS = ("pdsh", "standard", "nossh")


@dataclass(frozen=True)
class AccelerateConfig:
    """A checked Accelerate YAML: launch settings plus what it asks of the Runner.

    ``num_processes`` is the total over all machines, as in Accelerate. ``strategy`` is a spec
    ``(class name, kwargs)``; None for DEEPSPEED, whose strategy comes from ``deepspeed`` (a DeepSpeed
    config dict) through :func:`shardkit.config.deepspeed.resolve_deepspeed`.
    """

    path: Path
    distributed_type: str
    mixed_precision: str
    num_processes: int
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int | None
    use_cpu: bool
    gpu_ids: tuple[int, ...] | None
    strategy: StrategySpec | None
    deepspeed: dict[str, Any] | None = None
    deepspeed_source: str = ""
    env: dict[str, str] = field(default_factory=dict)
    hostfile: str | None = None
    include: str | None = None
    exclude: str | None = None

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines


def load_accelerate_config(path: str | os.PathLike) -> AccelerateConfig:
    """Read and check an Accelerate YAML; no devices are looked at (see :func:`check_resources`).

    Raises:
        ConfigKeyError: an unknown key (dotted, with the closest valid key).
        ConfigError: an impossible value or combination.
        NotImplementedError: a setting that shardkit cannot honour (another device family, TPU, fp8, ...).
    """
    path = Path(path).resolve()
    raw, where = load_mapping(path), str(path)
    check_known_keys(raw, TOP_KEYS, "", where)
    _check_unsupported(raw, where)
    kind = _distributed_type(raw, where)
    processes = _int(raw, "num_processes", where, 1, minimum=1)
    machines = _int(raw, "num_machines", where, 1, minimum=1)
    rank = _int(raw, "machine_rank", where, 0, minimum=0)
    if processes % machines:
        raise ConfigError(f"num_processes({processes}) in {where} is the total over all machines and must divide "
                          f"evenly by num_machines({machines})")
    if kind == "NO" and processes > 1:
        raise ConfigError(f"distributed_type: NO runs one process but num_processes is {processes} in {where}; "
                          f"use MULTI_GPU/MULTI_CPU (DDP) or num_processes: 1")
    mixed = str(raw.get("mixed_precision", "no") or "no").lower()
    if mixed == "fp8":
        raise NotImplementedError(f"mixed_precision: fp8 in {where} is not supported; use bf16 or fp16")
    if mixed not in _MIXED:
        raise ConfigError(f"mixed_precision: {raw['mixed_precision']!r} in {where}; use one of {list(_MIXED)}")
    _check_sections_match(raw, kind, where)
    use_cpu = bool(raw.get("use_cpu", False)) or kind == "MULTI_CPU"
    spec, ds, ds_where = _strategy(raw, kind, mixed, processes, path)
    port = raw.get("main_process_port")
    hostfile, include, exclude = _multinode_launch(raw.get("deepspeed_config") or {}, machines, where)
    return AccelerateConfig(
        path=path, distributed_type=kind, mixed_precision=mixed, num_processes=processes, num_machines=machines,
        machine_rank=rank, main_process_ip=raw.get("main_process_ip") or None,
        main_process_port=None if port is None else _int(raw, "main_process_port", where, 0, minimum=1,
                                                         maximum=65535),
        use_cpu=use_cpu, gpu_ids=_gpu_ids(raw.get("gpu_ids"), where), strategy=spec, deepspeed=ds,
        deepspeed_source=ds_where, env=_env(raw, use_cpu, path, spec), hostfile=hostfile, include=include,
        exclude=exclude,
    )


def _multinode_launch(section: Mapping[str, Any], machines: int, where: str) -> tuple[str | None, ...]:
    """(hostfile, include, exclude) of a DeepSpeed section's multi-machine launcher, as ``accelerate launch`` reads
    them: with several machines, "pdsh" (its default when a hostfile is named) starts every host over ssh from here
    (``shardkit launch --hostfile``); "standard" and "nossh" are started on each machine by hand."""
    launcher = section.get("deepspeed_multinode_launcher")
    hostfile = section.get("deepspeed_hostfile")
    key = "deepspeed_config.deepspeed_multinode_launcher"
    if launcher is not None and launcher not in MULTINODE_LAUNCHERS:
        if launcher in ("openmpi", "mvapich", "mpich", "slurm"):
            raise NotImplementedError(f"{key}: {launcher} in {where}: shardkit launches over ssh ('pdsh', with a "
                                      f"deepspeed_hostfile) or on each machine ('standard'); under SLURM use srun")
        raise ConfigError(f"{key}: {launcher!r} in {where}{did_you_mean(str(launcher), MULTINODE_LAUNCHERS)}; use "
                          f"one of {list(MULTINODE_LAUNCHERS)}")
    if machines == 1 or launcher in ("standard", "nossh") or (launcher is None and not hostfile):
        return None, None, None  # as accelerate launch: one machine, or every machine started by hand
    if not hostfile or not isinstance(hostfile, str):
        raise ConfigError(f"{key}: pdsh in {where} starts every machine over ssh and needs deepspeed_config."
                          f"deepspeed_hostfile (DeepSpeed's 'HOST slots=N' file), not {hostfile!r}")
    filters = {}
    for name in ("deepspeed_inclusion_filter", "deepspeed_exclusion_filter"):
        value = section.get(name)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"deepspeed_config.{name}: {value!r} in {where} must be DeepSpeed's "
                              "'HOST[:SLOT,...]@HOST...' string")
        filters[name] = value or None
    if filters["deepspeed_inclusion_filter"] and filters["deepspeed_exclusion_filter"]:
        # accelerate launch silently drops the inclusion filter then; DeepSpeed's runner refuses the pair
        raise ConfigError(f"deepspeed_config.deepspeed_inclusion_filter and deepspeed_exclusion_filter in {where}: "
                          "give one (the hosts to keep, or the hosts to drop), not both")
    include = filters["deepspeed_inclusion_filter"]
    # Relative to the directory the job runs in, as accelerate launch hands it to DeepSpeed's runner.
    return str(Path(hostfile).resolve()), include, filters["deepspeed_exclusion_filter"]


def _distributed_type(raw: Mapping[str, Any], where: str) -> str:
    value = raw.get("distributed_type", "NO")
    kind = "NO" if value is False else str(value).upper()  # YAML 1.1 reads an unquoted NO as false
    if kind in _OTHER_TYPES:
        raise NotImplementedError(f"distributed_type: {kind} in {where}: {_OTHER_TYPES[kind]} are not supported by "
                                  f"shardkit; use one of {list(DISTRIBUTED_TYPES)}")
    if kind not in DISTRIBUTED_TYPES:
        raise ConfigError(f"distributed_type: {raw.get('distributed_type')!r} in {where} is not a distributed type"
                          f"{did_you_mean(kind, DISTRIBUTED_TYPES)}; use one of {list(DISTRIBUTED_TYPES)}")
    return kind


def _check_unsupported(raw: Mapping[str, Any], where: str) -> None:
    env = str(raw.get("compute_environment", "LOCAL_MACHINE")).upper()
    if env != "LOCAL_MACHINE":
        raise NotImplementedError(f"compute_environment: {env} in {where}: only LOCAL_MACHINE is supported")
    backend = str(raw.get("rdzv_backend", "static")).lower()
    if backend != "static":
        raise NotImplementedError(f"rdzv_backend: {backend} in {where}: shardkit launch uses torchrun's static "
                                  f"rendezvous; use rdzv_backend: static")
    dynamo = raw.get("dynamo_config") or {}
    if not isinstance(dynamo, Mapping):
        raise ConfigError(f"dynamo_config in {where} must be a section (a mapping)")
    check_known_keys(dynamo, DYNAMO_KEYS, "dynamo_config", where)
    backend = str(dynamo.get("dynamo_backend", raw.get("dynamo_backend", "NO"))).upper()
    if backend != "NO":
        raise NotImplementedError(f"dynamo_backend: {backend} in {where}: shardkit does not compile the model for "
                                  f"you; call torch.compile(model) in the script and set dynamo_backend: 'NO'")
    for key in ("megatron_lm_config", "mpirun_config", "fp8_config", "ipex_config"):
        section = raw.get(key)
        if section is not None and not isinstance(section, Mapping):
            raise ConfigError(f"{key} in {where} must be a section (a mapping), not {section!r}; remove it (shardkit "
                              f"does not use it)")
        if section and any(v not in (None, False, "", [], {}) for v in section.values()):
            raise NotImplementedError(f"{key} in {where} is not supported by shardkit; remove it")


def _check_sections_match(raw: Mapping[str, Any], kind: str, where: str) -> None:
    owners = {"fsdp_config": "FSDP", "deepspeed_config": "DEEPSPEED", "tp_config": "TP"}
    for section, owner in owners.items():
        value = raw.get(section)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{section} in {where} must be a section (a mapping), not {value!r}")
        if value and kind != owner:
            raise ConfigError(f"{section} is set in {where} but distributed_type is {kind}, so it would be ignored; "
                              f"set distributed_type: {owner} or remove {section}")


def _int(raw: Mapping[str, Any], key: str, where: str, default: int, minimum: int,
         maximum: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
            (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"{key}: {value!r} in {where} must be a whole number >= {minimum}{upper}")
    return value


def _gpu_ids(value: Any, where: str) -> tuple[int, ...] | None:
    if value is None or str(value).strip().lower() == "all":
        return None
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        return tuple(int(str(i).strip()) for i in items if str(i).strip())
    except ValueError:
        raise ConfigError(f"gpu_ids: {value!r} in {where} must be 'all' or device indices like '0,1'") from None


def _env(raw: Mapping[str, Any], use_cpu: bool, path: Path, spec: StrategySpec | None) -> dict[str, str]:
    env = {CONFIG_FILE_ENV: str(path)}
    if spec is not None and spec[1].get("cpu_ram_efficient_loading"):
        # what `accelerate launch` exports for it: a script's from_pretrained, which runs before any Runner exists,
        # then leaves the weights on the meta device on every local rank but 0 (transformers reads these two)
        env.update(ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    ids = _gpu_ids(raw.get("gpu_ids"), str(path))
    if use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
    if raw.get("debug"):
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return env


# ---- strategies ------------------------------------------------------------------------------------


def _strategy(raw: Mapping[str, Any], kind: str, mixed: str, processes: int,
              path: Path) -> tuple[StrategySpec | None, dict[str, Any] | None, str]:
    where = str(path)
    section = raw.get("parallelism_config")
    if section:  # Accelerate's ND-parallel sizes (dp_replicate, dp_shard, cp, tp): one validated mesh
        from shardkit.strategies.parallel_dims import strategy_spec_from_accelerate

        return strategy_spec_from_accelerate(section, world_size_from_env() or processes, kind, where), None, ""
    if kind == "NO":
        return ("SingleDevice", {}), None, ""
    if kind in DATA_PARALLEL:
        return ("DDP", {}), None, ""
    if kind == "FSDP":
        return fsdp_spec(raw.get("fsdp_config") or {}, where), None, ""
    if kind == "TP":
        return _tp_spec(raw.get("tp_config") or {}, processes, where), None, ""
    ds, ds_where = _deepspeed_dict(raw.get("deepspeed_config") or {}, mixed, raw, path)
    return None, ds, ds_where


def _tp_spec(section: Mapping[str, Any], processes: int, where: str) -> StrategySpec:
    check_known_keys(section, TP_KEYS, "tp_config", where)
    size = section.get("tp_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"tp_config.tp_size: {size!r} in {where} must be a whole number >= 1")
    world = world_size_from_env() or processes
    if world % size:
        raise ConfigError(f"world size {world} (num_processes) is not divisible by tp_config.tp_size({size}) in "
                          f"{where}; use a tp_size that divides it")
    kwargs: dict[str, Any] = {"tp_size": size}
    if world > size:
        log.info("%s: %d processes with tp_size %d: the remaining data-parallel dimension (%d) shards with FSDP",
                 where, world, size, world // size)
        kwargs["dp"] = "fsdp"
    return "TensorParallel", kwargs


def _deepspeed_dict(section: Mapping[str, Any], mixed: str, raw: Mapping[str, Any],
                    path: Path) -> tuple[dict[str, Any], str]:
    """The DeepSpeed config the deepspeed_config section stands for: its file, or one built from inline keys."""
    where = f"{path} (deepspeed_config)"
    check_known_keys(section, DEEPSPEED_KEYS, "deepspeed_config", str(path))
    if section.get("deepspeed_config_file"):
        inline = sorted(set(section) & {"zero_stage", "offload_optimizer_device", "offload_param_device",
                                        "offload_optimizer_nvme_path", "offload_param_nvme_path",
                                        "gradient_accumulation_steps", "gradient_clipping", "zero3_save_16bit_model"})
        if inline:
            raise ConfigError(f"deepspeed_config in {path} names deepspeed_config_file and also {inline}; put those "
                              f"in the JSON file")
        if not isinstance(section["deepspeed_config_file"], str):
            raise ConfigError(f"deepspeed_config.deepspeed_config_file: {section['deepspeed_config_file']!r} in "
                              f"{path} must be the path of a DeepSpeed JSON file")
        # As accelerate launch hands it to DeepSpeedPlugin: as written, so a relative path starts at the directory
        # the job runs in, not at the YAML's.
        file = Path(section["deepspeed_config_file"])
        if not file.is_file():
            beside = path.parent / file
            hint = f"; there is one beside the YAML: name it {str(beside)!r}" if not file.is_absolute() and \
                beside.is_file() else ""
            raise ConfigError(f"deepspeed_config.deepspeed_config_file: {str(file.resolve())!r} named in {path} is "
                              f"not a file; fix the path (a relative path starts at the directory the job runs in, "
                              f"as in accelerate launch){hint}")
        return load_mapping(file), str(file)
    return _inline_deepspeed(section, mixed, where), where


def _inline_deepspeed(section: Mapping[str, Any], mixed: str, where: str) -> dict[str, Any]:
    stage = section.get("zero_stage", 2)
    zero: dict[str, Any] = {"stage": stage}
    for name, prefix in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_param")):
        device = str(section.get(f"{prefix}_device", "none")).lower()
        if device == "none":
            continue
        if name == "offload_param" and isinstance(stage, int) and stage < 3:
            # Accelerate writes this key for every stage and DeepSpeed ignores it below stage 3.
            warn_once(f"deepspeed:offload_param_device:{where}", f"{where}: offload_param_device: {device} has no "
                      f"effect at zero_stage {stage} (parameters are partitioned only in stage 3); ignored")
            continue
        zero[name] = {"device": device}
        if section.get(f"{prefix}_nvme_path"):
            zero[name]["nvme_path"] = section[f"{prefix}_nvme_path"]
    if "zero3_save_16bit_model" in section and stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = bool(section["zero3_save_16bit_model"])
    if section.get("zero3_init_flag") and stage != 3:
        warn_once(f"deepspeed:zero3_init_flag:{where}", f"{where}: zero3_init_flag applies to zero_stage 3 only; "
                  f"ignored at stage {stage}")
    elif section.get("zero3_init_flag"):
        warn_once("deepspeed:zero3_init_flag", f"{where}: zero3_init_flag: true has no effect by itself: build the "
                  f"model inside runner.init_module(), where ZeRO3 partitions it as it is built (deepspeed.zero.Init)")
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if key in section and section[key] != "auto":
            check_number(section[key], f"deepspeed_config.{key}", where, integer=key != "gradient_clipping",
                         minimum=1 if key == "gradient_accumulation_steps" else 0)
    config: dict[str, Any] = {"zero_optimization": zero}
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if key in section:
            config[key] = section[key]
    if mixed != "no":
        config[mixed] = {"enabled": True}
    return config


def fsdp_strategy_from_section(section: Mapping[str, Any], where: str) -> Any:
    """The FSDP strategy an ``fsdp_config`` section (Accelerate's YAML keys) asks for; ``where`` names it in errors."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where} must be a mapping of fsdp_config keys, not {type(section).__name__}")
    return build_strategy(fsdp_spec(section, where))


def deepspeed_config_from_section(section: Mapping[str, Any], mixed_precision: str, where: str) -> dict[str, Any]:
    """The DeepSpeed config dict a ``deepspeed_config`` section's inline keys (``zero_stage``,
    ``offload_optimizer_device`` ...) stand for, with ``mixed_precision``'s section enabled."""
    check_known_keys(section, DEEPSPEED_KEYS, "", where)
    return _inline_deepspeed(section, mixed_precision, where)


# ---- resolution for the Runner ---------------------------------------------------------------------


def resolve_accelerate(path: str | os.PathLike, *, strategy: Any = None, precision: Any = None,
                       gradient_accumulation_steps: int | None = None, micro_batch_size: int | None = None,
                       max_grad_norm: float | None = None, world_size: int | None = None,
                       optimizer_params: Mapping[str, Any] | None = None,
                       scheduler_params: Mapping[str, Any] | None = None,
                       explicit_precision_wins: bool = False) -> ResolvedConfig:
    """The Runner settings an Accelerate YAML asks for, checked against the Runner's explicit values.

    ``explicit_precision_wins``: the file came from the launcher, so a precision given to the Runner (the
    Trainer's ``--bf16``) overrides its ``mixed_precision`` with one warning, as transformers and Accelerate let
    an explicit argument win over ``accelerate launch``'s config; otherwise disagreeing is an error.
    """
    from shardkit.precision.registry import PRECISIONS

    cfg = load_accelerate_config(path)
    where = str(cfg.path)
    file_precision = PRECISIONS.build(cfg.mixed_precision)  # "no" is fp32's alias
    wins = explicit_precision_wins
    if cfg.deepspeed is not None:
        names = None
        if cfg.mixed_precision != "no":
            # The YAML's mixed_precision fills the DeepSpeed file's fp16/bf16 "auto", as Accelerate does.
            precision = _precision(file_precision, cfg, precision, wins)
            names = {"precision": f"mixed_precision: {cfg.mixed_precision} in {where}"}
        return resolve_deepspeed(
            cfg.deepspeed, strategy=strategy, precision=precision,
            world_size=world_size or world_size_from_env() or cfg.num_processes,
            gradient_accumulation_steps=gradient_accumulation_steps, micro_batch_size=micro_batch_size,
            max_grad_norm=max_grad_norm, optimizer_params=optimizer_params, scheduler_params=scheduler_params,
            source=cfg.deepspeed_source, runner_names=names,
        )
    return ResolvedConfig(
        strategy=_runner_strategy(cfg, strategy), precision=_precision(file_precision, cfg, precision, wins),
        gradient_accumulation_steps=gradient_accumulation_steps or 1, micro_batch_size=micro_batch_size,
        max_grad_norm=max_grad_norm, optimizer=None, scheduler=None, source=where,
    )


def _precision(file_precision: Any, cfg: AccelerateConfig, precision: Any, explicit_wins: bool = False) -> Any:
    if precision is None:
        return file_precision
    file_kind, runner_kind = precision_kind(file_precision), precision_kind(precision)
    if explicit_wins and file_kind != runner_kind:
        warn_once(f"precision-override:{cfg.path}", f"mixed_precision: {cfg.mixed_precision} in {cfg.path} (the "
                  f"launcher's config) is overridden by precision={precision!r} given to the Runner (the training "
                  f"arguments win, as in transformers)")
        return precision
    reconcile("mixed_precision", file_kind, str(cfg.path), runner_kind, f"Runner(precision={precision!r})")
    return precision


def _runner_strategy(cfg: AccelerateConfig, strategy: Any) -> Any:
    name, kwargs = cfg.strategy
    if strategy is None:
        return build_strategy((name, kwargs))
    if is_registered_as(strategy, name) and not kwargs:
        return strategy  # DDP / SingleDevice: the file sets nothing the object could disagree with
    raise ConfigMismatchError(f"strategy: {name} (distributed_type: {cfg.distributed_type}) in {cfg.path} but "
                              f"{type(strategy).__name__} from Runner(strategy=...); set it in one place")


# ---- devices and launching -------------------------------------------------------------------------


def check_resources(cfg: AccelerateConfig, device_count: int | None = None) -> None:
    """Raise ConfigResourceError when ``cfg`` asks for more processes, devices or machines than exist.

    Args:
        cfg: a loaded config.
        device_count: CUDA devices on this machine (default: torch.cuda.device_count(); 0 = CPU only).
    """
    where = str(cfg.path)
    if cfg.num_machines > 1 and not cfg.main_process_ip:
        raise ConfigResourceError(f"num_machines: {cfg.num_machines} in {where} needs main_process_ip, the address of "
                                  f"machine 0 that every machine can reach")
    if not 0 <= cfg.machine_rank < cfg.num_machines:
        raise ConfigResourceError(f"machine_rank: {cfg.machine_rank} in {where} is out of range for num_machines: "
                                  f"{cfg.num_machines} (use 0..{cfg.num_machines - 1})")
    if cfg.use_cpu:
        return
    if device_count is None:
        import torch

        device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_count == 0:
        log.warning("%s: no CUDA device is visible, so the %d processes per machine run on CPU (gloo) with the "
                    "same strategy", where, cfg.processes_per_machine)
        return
    ids = cfg.gpu_ids if cfg.gpu_ids is not None else tuple(range(device_count))
    missing = [i for i in ids if i >= device_count]
    if missing:
        raise ConfigResourceError(f"gpu_ids {list(ids)} in {where}: this machine has {device_count} GPUs, so "
                                  f"{missing} do not exist")
    if cfg.processes_per_machine > len(ids):
        raise ConfigResourceError(
            f"{where} asks for {cfg.processes_per_machine} processes per machine (num_processes {cfg.num_processes} / "
            f"num_machines {cfg.num_machines}) but only {len(ids)} GPUs are available here; lower num_processes, "
            f"or set use_cpu: true to run on CPU")


def _check_deepspeed(cfg: AccelerateConfig) -> None:
    """The DeepSpeed settings' own checks, without building a strategy: a bad value fails at launch, not in N ranks."""
    from shardkit.config.deepspeed import strategy_spec_from_deepspeed
    from shardkit.config.deepspeed_schema import walk
    from shardkit.config.optim import resolve_optimizer
    from shardkit.strategies.zero.config import require_deepspeed

    raw, where = cfg.deepspeed, cfg.deepspeed_source
    try:
        require_deepspeed(f"distributed_type: DEEPSPEED in {cfg.path}")
    except ImportError as err:
        raise ConfigError(str(err)) from None
    walk(raw, where)
    strategy_spec_from_deepspeed(raw, where, cfg.num_processes)
    # NOTE: the scheduler waits for the Runner: its "auto" total_num_steps is known only to the training script.
    resolve_optimizer(raw.get("optimizer"), where)


def launch_args_from_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """What `shardkit launch --config_file` needs: per-machine process count, machines, rank, address, env.

    The environment carries ``SHARDKIT_CONFIG_FILE`` (the YAML's absolute path) so that ``Runner()`` in the
    launched script builds the strategy and precision the file asks for.
    """
    from shardkit.distributed.cli import LaunchUsageError

    try:
        cfg = load_accelerate_config(path)
        if cfg.hostfile is None:  # else each host's agent checks its own devices
            check_resources(cfg)
        if cfg.deepspeed is not None:
            _check_deepspeed(cfg)
    except (ConfigError, NotImplementedError) as err:
        raise LaunchUsageError(f"--config-file {path}: {err}") from None
    args: dict[str, Any] = {"num_processes": cfg.processes_per_machine, "num_machines": cfg.num_machines,
                            "machine_rank": cfg.machine_rank, "env": dict(cfg.env)}
    if cfg.main_process_ip:
        args["main_process_ip"] = cfg.main_process_ip
    if cfg.main_process_port is not None:
        args["main_process_port"] = cfg.main_process_port
    for key in ("hostfile", "include", "exclude"):
        if getattr(cfg, key) is not None:
            args[key] = getattr(cfg, key)
    return args
