"""Accelerate's configuration objects, and what each one means as a shardkit Strategy, Precision and Runner setting.

The classes here carry Accelerate's names, fields and defaults. Every reader below takes Accelerate's own
objects too (``accelerate.utils.DistributedDataParallelKwargs``, ``DeepSpeedPlugin``,
``FullyShardedDataParallelPlugin`` ...): it reads them by attribute, never by type. A setting shardkit cannot
honour is refused with the setting's name and what to do instead; none is dropped silently.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from shardkit.precision import Precision

__all__ = ["AutocastKwargs", "DataLoaderConfiguration", "DistributedDataParallelKwargs", "GradScalerKwargs",
           "GradientAccumulationPlugin", "InitProcessGroupKwargs", "ProjectConfiguration", "apply_init_kwargs",
           "check_argument_types", "default_strategy", "deepspeed_config", "fsdp_strategy", "launched_engine",
           "precision_for", "read_handlers"]


class _Kwargs:
    """Accelerate's ``KwargsHandler``: :meth:`to_kwargs` gives the fields set to something else than the default."""

    def to_kwargs(self) -> dict[str, Any]:
        default = type(self)()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


@dataclasses.dataclass
class GradientAccumulationPlugin(_Kwargs):
    """How ``Accelerator.accumulate`` windows gradients.

    Args:
        num_steps: micro-batches per optimizer step.
        adjust_scheduler: a scheduler step skipped mid-window still counts toward the scheduler's step count.
        sync_with_dataloader: the last batch of a data loader ends the window (and a new one starts with the
            next loader).
        sync_each_batch: reduce gradients on every micro-batch (more traffic, no ``no_sync`` memory).
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclasses.dataclass
class DataLoaderConfiguration(_Kwargs):
    """How ``prepare`` shards data loaders.

    Args:
        split_batches: the loader's ``batch_size`` is the global batch, split over the processes (it must divide
            by their number); otherwise each process takes batches of ``batch_size``.
        dispatch_batches: accepted; every process reads its own share (the batches are the same).
        even_batches: True: every process gets as many batches, the last round completed with the epoch's first
            samples (``gather_for_metrics`` drops the repeats); False: nothing repeated, so the first processes may
            get one batch more (loop under ``join_uneven_inputs``). Map-style datasets only.
        use_seedable_sampler: accepted; the order always depends only on the seed and the epoch.
        data_seed: the shuffling seed (default: drawn from torch's RNG on the main process at ``prepare``, so
            ``set_seed`` decides it).
        non_blocking: accepted (batches are moved with ``non_blocking=True`` already).
        use_stateful_dataloader: accepted; prepared loaders always have ``state_dict``/``load_state_dict`` and
            ``save_state`` keeps their positions.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclasses.dataclass
class ProjectConfiguration(_Kwargs):
    """Where ``save_state`` and the trackers write.

    Args:
        project_dir: the project's directory.
        logging_dir: the trackers' directory (default: ``project_dir``).
        automatic_checkpoint_naming: ``save_state()`` writes ``<project_dir>/checkpoints/checkpoint_<iteration>``.
        total_limit: with automatic naming, keep at most this many checkpoints.
        iteration: the number of the next automatically named checkpoint.
        save_on_each_node: accepted; every machine must see the same filesystem.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | None = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` when it is unset)."""
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclasses.dataclass
class DistributedDataParallelKwargs(_Kwargs):
    """torch DDP's options. ``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph`` and
    ``gradient_as_bucket_view`` become :class:`shardkit.DDP`'s; the others must keep their defaults."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = None
    comm_wrapper: Any = None
    comm_state_option: dict | None = None


@dataclasses.dataclass
class InitProcessGroupKwargs(_Kwargs):
    """The process group's options: ``timeout`` bounds every collective; ``backend`` must be the device's
    (gloo on CPUs, nccl on GPUs)."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclasses.dataclass
class GradScalerKwargs(_Kwargs):
    """torch's ``GradScaler`` options, as :class:`shardkit.FP16`'s dynamic loss scale takes them."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclasses.dataclass
class AutocastKwargs(_Kwargs):
    """``torch.autocast`` options for ``Accelerator.autocast``; only the defaults are supported."""

    enabled: bool = True
    cache_enabled: bool | None = None


# ---- kwargs handlers ------------------------------------------------------------------------------------

_HANDLERS = {"DistributedDataParallelKwargs": "ddp", "InitProcessGroupKwargs": "init", "GradScalerKwargs": "scaler",
             "AutocastKwargs": "autocast", "GradientAccumulationPlugin": "accumulation"}
_UNSUPPORTED_HANDLERS = {"FP8RecipeKwargs": "fp8 training", "AORecipeKwargs": "fp8 training",
                         "TERecipeKwargs": "fp8 training", "MSAMPRecipeKwargs": "fp8 training",
                         "ProfileKwargs": "Accelerator.profile (use torch.profiler directly)",
                         "TorchDynamoPlugin": "compiling the model (call torch.compile(model) in the script)",
                         "DistributedDataParallelCommunicationHook": "DDP communication hooks"}


def read_handlers(handlers: Iterable[Any] | None) -> dict[str, Any]:
    """``kwargs_handlers`` by kind ("ddp", "init", "scaler", "autocast", "accumulation"); each kind at most once."""
    found: dict[str, Any] = {}
    for handler in handlers or ():
        name = type(handler).__name__
        kind = _HANDLERS.get(name)
        if kind is None:
            why = _UNSUPPORTED_HANDLERS.get(name)
            known = ", ".join(_HANDLERS)
            if why is None and not hasattr(handler, "to_kwargs"):
                raise TypeError(f"kwargs_handlers holds {handler!r} ({name}), which is not a kwargs handler; "
                                f"shardkit takes {known}")
            raise NotImplementedError(f"kwargs_handlers: {name} is not supported" + (f" ({why})" if why else "") +
                                      f"; shardkit takes {known}")
        if kind in found:
            raise ValueError(f"kwargs_handlers holds two {name} objects; pass one")
        found[kind] = handler
    return found


def to_kwargs(handler: Any) -> dict[str, Any]:
    """The non-default fields of one of Accelerate's handlers (its own ``to_kwargs``), read by attribute."""
    method = getattr(handler, "to_kwargs", None)
    return dict(method()) if callable(method) else dict(vars(handler))


_DDP_FIELDS = ("bucket_cap_mb", "find_unused_parameters", "static_graph", "gradient_as_bucket_view")


def ddp_options(handler: Any) -> dict[str, Any]:
    """:class:`shardkit.DDP` keyword arguments for a ``DistributedDataParallelKwargs``."""
    options = to_kwargs(handler)
    other = sorted(k for k, v in options.items() if k not in _DDP_FIELDS and _set(v))
    if other:
        raise NotImplementedError(f"DistributedDataParallelKwargs({', '.join(f'{k}=...' for k in other)}): shardkit's "
                                  f"DDP takes {list(_DDP_FIELDS)} only; gradients are reduced in the precision's "
                                  f"comm_dtype (e.g. BF16(comm_dtype='bf16') instead of a bf16 comm hook)")
    return {k: v for k, v in options.items() if k in _DDP_FIELDS}


def _set(value: Any) -> bool:
    """False for Accelerate's "nothing chosen" values (None, an enum named NO, an empty dict)."""
    return value not in (None, {}) and getattr(value, "name", None) != "NO"


def apply_init_kwargs(handler: Any) -> None:
    """Honour an ``InitProcessGroupKwargs``: its timeout bounds every collective of this process (set before the
    process group exists); a backend or init method other than the device's default is refused."""
    import torch

    from shardkit.distributed import TIMEOUT_ENV_VAR, backend_for_device

    options = to_kwargs(handler)
    backend = options.get("backend", getattr(handler, "backend", None))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend is not None and "backend" in options and backend != backend_for_device(device):
        raise NotImplementedError(f"InitProcessGroupKwargs(backend={backend!r}): shardkit uses "
                                  f"{backend_for_device(device)!r} on {device}; remove backend=")
    if options.get("init_method") not in (None, "env://"):
        raise NotImplementedError(f"InitProcessGroupKwargs(init_method={options['init_method']!r}): shardkit joins "
                                  f"through the launcher's environment (env://); remove init_method=")
    timeout = options.get("timeout")
    if timeout is not None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        os.environ[TIMEOUT_ENV_VAR] = repr(seconds)  # read when the process group is created


# ---- precision -----------------------------------------------------------------------------------------

def precision_for(mixed_precision: str | None, scaler: Any = None) -> Precision | None:
    """The Precision for Accelerate's ``mixed_precision`` ("no", "fp16", "bf16"; None: ``ACCELERATE_MIXED_PRECISION``
    or the Runner's config decides). fp16 scales the loss as torch's GradScaler does (2**16, doubled after 2000
    good steps, halved on each overflow) unless a ``GradScalerKwargs`` says otherwise."""
    from shardkit.precision.registry import PRECISIONS
    from shardkit.utils.suggest import did_you_mean

    name = mixed_precision if mixed_precision is not None else os.environ.get("ACCELERATE_MIXED_PRECISION")
    if name is None:
        if scaler is not None:
            raise ValueError("kwargs_handlers has a GradScalerKwargs but mixed_precision is not 'fp16'")
        return None
    name = str(getattr(name, "value", name)).lower()
    if name == "fp8":
        raise NotImplementedError("mixed_precision='fp8' is not supported by shardkit; use 'bf16' or 'fp16'")
    if name not in ("no", "fp16", "bf16"):
        raise ValueError(f"mixed_precision={name!r} is not one of 'no', 'fp16', 'bf16'{did_you_mean(name, _MIXED)}")
    if name != "fp16":
        if scaler is not None:
            raise ValueError(f"kwargs_handlers has a GradScalerKwargs but mixed_precision is {name!r}, not 'fp16'")
        return PRECISIONS.build(name)
    return PRECISIONS.build("fp16", **_scaler_options(scaler))


_MIXED = ("no", "fp16", "bf16")


def _scaler_options(scaler: Any) -> dict[str, Any]:
    values = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
              "enabled": True}
    if scaler is not None:
        values.update(to_kwargs(scaler))
    if values["growth_factor"] != 2.0 or values["backoff_factor"] != 0.5:
        raise NotImplementedError(f"GradScalerKwargs(growth_factor={values['growth_factor']}, backoff_factor="
                                  f"{values['backoff_factor']}): shardkit's FP16 doubles and halves the scale; keep "
                                  f"2.0 and 0.5")
    if not values["enabled"]:
        return {"loss_scale": 1.0}  # a fixed scale of 1: no scaling, as a disabled GradScaler
    power = math.log2(values["init_scale"]) if values["init_scale"] > 0 else -1.0
    if not power.is_integer() or power < 0:
        raise ValueError(f"GradScalerKwargs(init_scale={values['init_scale']}) must be a power of two (FP16 starts at "
                         f"2**initial_scale_power)")
    return {"initial_scale_power": int(power), "loss_scale_window": int(values["growth_interval"]), "hysteresis": 1}


# ---- argument types ------------------------------------------------------------------------------------

# Argument -> (an attribute its objects have, what to pass): Accelerate's classes and shardkit's are both read by
# attribute, so the check is by attribute too.
_ARGUMENT_KINDS = {
    "dataloader_config": ("split_batches", "a DataLoaderConfiguration"),
    "project_config": ("automatic_checkpoint_naming", "a ProjectConfiguration"),
    "gradient_accumulation_plugin": ("num_steps", "a GradientAccumulationPlugin"),
    "deepspeed_plugin": ("deepspeed_config", "a DeepSpeedPlugin, a DeepSpeed config dict or a dict of "
                                             "DeepSpeedPlugin's fields"),
    "fsdp_plugin": ("fsdp_version", "a FullyShardedDataParallelPlugin or a dict of its fields / fsdp_config keys"),
}


def check_argument_types(**arguments: Any) -> None:
    """A TypeError naming the argument for anything that is not what Accelerate takes there (``fsdp_plugin=5``
    would otherwise run plain FSDP defaults)."""
    for name, value in arguments.items():
        if value is None:
            continue
        if name == "kwargs_handlers":
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
                raise TypeError(f"Accelerator(kwargs_handlers={value!r}) must be a list of handlers, e.g. "
                                f"[DistributedDataParallelKwargs(...)]")
            continue
        attribute, wanted = _ARGUMENT_KINDS[name]
        if isinstance(value, Mapping) and name == "deepspeed_plugin" and value and \
                all(hasattr(v, "deepspeed_config") for v in value.values()):
            raise NotImplementedError(f"deepspeed_plugin={{{', '.join(map(repr, value))}: DeepSpeedPlugin ...}}: "
                                      f"several DeepSpeed plugins are not supported by shardkit; pass one")
        if isinstance(value, Mapping) and name in ("deepspeed_plugin", "fsdp_plugin"):
            continue
        if not hasattr(value, attribute):
            raise TypeError(f"Accelerator({name}={value!r}): expected {wanted}, got {type(value).__name__}")


# ---- strategies ----------------------------------------------------------------------------------------

def default_strategy(cpu: bool = False, ddp: Mapping[str, Any] | None = None) -> Any:
    """The strategy ``Runner()`` picks (DDP under a launcher, else SingleDevice), with DDP's options and ``cpu``."""
    import torch

    from shardkit.strategies.ddp import DDP
    from shardkit.strategies.single import SingleDevice

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return SingleDevice("cpu" if cpu else None)
    if cpu and torch.cuda.is_available():
        raise NotImplementedError(f"Accelerator(cpu=True) with {world} processes on a machine with GPUs: hide them "
                                  f"from the job instead (CUDA_VISIBLE_DEVICES= shardkit launch ...)")
    return DDP(**dict(ddp or {}))


_DS_PLUGIN_KEYS = ("hf_ds_config", "zero_stage", "offload_optimizer_device", "offload_param_device",
                   "offload_optimizer_nvme_path", "offload_param_nvme_path", "zero3_init_flag",
                   "zero3_save_16bit_model")


def deepspeed_config(plugin: Any, mixed_precision: str) -> dict[str, Any]:
    """The DeepSpeed config a ``deepspeed_plugin`` stands for.

    ``plugin`` is a DeepSpeed config dict, a dict of ``DeepSpeedPlugin``'s fields (``zero_stage``,
    ``offload_optimizer_device``, ``hf_ds_config`` ...) or Accelerate's ``DeepSpeedPlugin`` (its
    ``deepspeed_config``).
    """
    from shardkit.config.accelerate import deepspeed_config_from_section
    from shardkit.config.common import load_mapping

    if not isinstance(plugin, Mapping):
        config = getattr(plugin, "deepspeed_config", None)
        if not isinstance(config, Mapping):
            raise TypeError(f"deepspeed_plugin={type(plugin).__name__}: pass a DeepSpeed config dict, a dict of "
                            f"DeepSpeedPlugin's fields, or accelerate.utils.DeepSpeedPlugin")
        config = dict(config)
        if config.get("steps_per_print") == math.inf:
            del config["steps_per_print"]  # DeepSpeedPlugin's "never print": DeepSpeed's step logs are off here anyway
        return config
    if not set(plugin) & set(_DS_PLUGIN_KEYS):
        return dict(plugin)
    if "hf_ds_config" in plugin:
        other = sorted(set(plugin) - {"hf_ds_config"})
        if other:
            raise ValueError(f"deepspeed_plugin names hf_ds_config and also {other}; put those in the DeepSpeed "
                             f"config")
        config = plugin["hf_ds_config"]
        return dict(config) if isinstance(config, Mapping) else load_mapping(config)
    return deepspeed_config_from_section(plugin, mixed_precision, "deepspeed_plugin")


# DeepSpeedPlugin / FullyShardedDataParallelPlugin attribute -> the Accelerate YAML key shardkit's reader takes.
_FSDP_ATTRIBUTES = {"sharding_strategy": "fsdp_sharding_strategy",
                    "reshard_after_forward": "fsdp_reshard_after_forward", "auto_wrap_policy": "fsdp_auto_wrap_policy",
                    "transformer_cls_names_to_wrap": "fsdp_transformer_layer_cls_to_wrap",
                    "min_num_params": "fsdp_min_num_params", "cpu_offload": "fsdp_offload_params",
                    "state_dict_type": "fsdp_state_dict_type",
                    "activation_checkpointing": "fsdp_activation_checkpointing",
                    "sync_module_states": "fsdp_sync_module_states",
                    "cpu_ram_efficient_loading": "fsdp_cpu_ram_efficient_loading", "fsdp_version": "fsdp_version",
                    "backward_prefetch": "fsdp_backward_prefetch", "forward_prefetch": "fsdp_forward_prefetch",
                    "use_orig_params": "fsdp_use_orig_params"}
_FSDP_REFUSED = ("mixed_precision_policy", "ignored_modules", "param_init_fn", "activation_checkpointing_offload")


def fsdp_strategy(plugin: Any) -> Any:
    """The :class:`shardkit.FSDP` an ``fsdp_plugin`` asks for: a dict of Accelerate's YAML ``fsdp_config`` keys or
    of ``FullyShardedDataParallelPlugin``'s fields, or that plugin itself."""
    from shardkit.config.accelerate import fsdp_strategy_from_section

    if isinstance(plugin, Mapping):
        section = {(k if str(k).startswith("fsdp_") else _FSDP_ATTRIBUTES.get(k, f"fsdp_{k}")): _plain(k, v)
                   for k, v in plugin.items() if k not in _FSDP_REFUSED or _refuse_fsdp(k, v)}
    else:
        for name in _FSDP_REFUSED:
            _refuse_fsdp(name, getattr(plugin, name, None))
        section = {key: _plain(attr, getattr(plugin, attr)) for attr, key in _FSDP_ATTRIBUTES.items()
                   if getattr(plugin, attr, None) is not None}
    return fsdp_strategy_from_section(section, "fsdp_plugin")


def _refuse_fsdp(name: str, value: Any) -> bool:
    if value not in (None, False):
        hint = "set the precision with Accelerator(mixed_precision=...)" if name == "mixed_precision_policy" else \
            "remove it"
        raise NotImplementedError(f"fsdp_plugin {name}={value!r} is not supported by shardkit's FSDP; {hint}")
    return False


def _plain(name: str, value: Any) -> Any:
    """A plugin attribute as the YAML reader takes it: enums by name, offload policies as bool, wrap policy names."""
    if name in ("cpu_offload", "fsdp_offload_params") and not isinstance(value, (bool, str)):
        offload = getattr(value, "offload_params", None)  # FSDP1's CPUOffload
        return bool(offload) if offload is not None else type(value).__name__ == "CPUOffloadPolicy"
    if name in ("auto_wrap_policy", "fsdp_auto_wrap_policy") and callable(value):
        raise NotImplementedError("fsdp_plugin auto_wrap_policy as a function is not supported; name the blocks with "
                                  "transformer_cls_names_to_wrap=[...] or give min_num_params")
    if hasattr(value, "name") and not isinstance(value, str):  # torch's ShardingStrategy, StateDictType, ...
        return value.name
    if name in ("auto_wrap_policy", "fsdp_auto_wrap_policy") and isinstance(value, str):
        return value.upper()
    return value


def launched_engine(mixed: str, deepspeed_plugin: Any, fsdp_plugin: Any) -> Any:
    """What ``accelerate launch``'s variables ask for (an FSDP strategy or a DeepSpeed config), or None.

    None under ``shardkit launch`` (its ranks read the YAML itself) and when a plugin argument names the same
    engine (the argument wins, as in Accelerate); a plugin for the other engine is a contradiction, refused.
    """
    from shardkit.config.accelerate_env import from_accelerate_launch

    launched = from_accelerate_launch(mixed)
    given = "deepspeed_plugin" if deepspeed_plugin is not None else "fsdp_plugin" if fsdp_plugin is not None else None
    if launched is None or given is None:
        return launched
    if (launched.kind == "FSDP") != (given == "fsdp_plugin"):
        raise ValueError(f"{launched.source} asks for {launched.kind} but Accelerator({given}=...) asks for the other "
                         f"engine; launch with the config that matches the script, or drop {given}=")
    return None
