"""What ``accelerate launch`` hands a script through the environment, read back as the YAML settings it came from.

``accelerate launch --config_file fsdp.yaml train.py`` does not pass the file on: it exports
``ACCELERATE_USE_FSDP=true`` and one ``FSDP_*`` variable per option (``ACCELERATE_USE_DEEPSPEED`` and
``ACCELERATE_DEEPSPEED_*`` for DeepSpeed), and Accelerate's plugins read them back. Here each variable becomes the
Accelerate YAML key it was written from, and the section goes through the same translator as a file
(:func:`shardkit.config.fsdp_options.fsdp_spec`, :func:`shardkit.config.accelerate.deepspeed_config_from_section`),
so that ``accelerate launch`` and ``shardkit launch`` with one YAML build one strategy. Errors name the variable.
What shardkit cannot honour (Megatron-LM, torch.compile, Accelerate's ND-parallelism variables) is refused by name.

    from shardkit.config.accelerate_env import launch_environment
    launched = launch_environment()          # None outside accelerate launch's FSDP/DeepSpeed variables

Every front reads them the same way: the Accelerator, the Trainer and a bare Runner take the launcher's engine when
the script names none, keep the script's strategy when it is of the class the launcher asked for (as Accelerate lets
a plugin argument win), and refuse a strategy of another class by name (:func:`reconcile_strategy`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.config.common import (
    CONFIG_FILE_ENV,
    ConfigError,
    ConfigMismatchError,
    load_mapping,
    warn_once,
    world_size_from_env,
)

__all__ = ["DEEPSPEED_ENV", "FSDP_ENV", "LaunchEnvironment", "from_accelerate_launch", "launch_environment",
           "launcher_read", "reconcile_strategy", "asks_for_deepspeed"]

# accelerate launch's variable -> the fsdp_config key it carries (accelerate/utils/launch.py, prepare_multi_gpu_env).
FSDP_ENV = {"FSDP_VERSION": "fsdp_version", "FSDP_SHARDING_STRATEGY": "fsdp_sharding_strategy",
            "FSDP_RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward", "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params",
            "FSDP_MIN_NUM_PARAMS": "fsdp_min_num_params", "FSDP_AUTO_WRAP_POLICY": "fsdp_auto_wrap_policy",
            "FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
            "FSDP_BACKWARD_PREFETCH": "fsdp_backward_prefetch", "FSDP_STATE_DICT_TYPE": "fsdp_state_dict_type",
            "FSDP_FORWARD_PREFETCH": "fsdp_forward_prefetch", "FSDP_USE_ORIG_PARAMS": "fsdp_use_orig_params",
            "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading",
            "FSDP_SYNC_MODULE_STATES": "fsdp_sync_module_states",
            "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing"}
# accelerate launch writes these two on every FSDP launch, its own defaults included; a default value is left out so
# that the YAML translator's default (the same) applies and the option the YAML did set is read as it is there.
_LAUNCHER_DEFAULTS = {"FSDP_SHARDING_STRATEGY": "FULL_SHARD", "FSDP_RESHARD_AFTER_FORWARD": "true"}
# ... and the deepspeed_config key (prepare_deepspeed_cmd_env; the NVMe paths are read by DeepSpeedPlugin).
DEEPSPEED_ENV = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
                 "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
                 "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
                 "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "offload_optimizer_nvme_path",
                 "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "offload_param_nvme_path",
                 "ACCELERATE_DEEPSPEED_ZERO3_INIT": "zero3_init_flag",
                 "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model"}
CONFIG_FILE_VAR = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
# Variables asking for what shardkit does not do, and what to do instead.
_REFUSED = {
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "offloading checkpointed activations is not supported by shardkit's "
                                             "FSDP; set fsdp_activation_checkpointing_offload: false",
    "FSDP_IGNORED_MODULES": "shardkit's FSDP shards every module; freeze parameters with requires_grad=False instead "
                            "and remove fsdp_ignored_modules",
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "DeepSpeed MoE leaf modules are not supported by shardkit; remove "
                                                "deepspeed_moe_layer_cls_names",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM is not supported by shardkit",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "Accelerate's ND parallelism under shardkit.Accelerator is not supported; "
                                         "start the script with `shardkit launch --config_file` (a Runner reads "
                                         "parallelism_config there) or use shardkit.Runner with ContextParallel / "
                                         "TensorParallel",
}
_OFF = ("", "false", "0", "no", "none")
# Set while a front that has already read the variables (the Trainer) builds its Runner, which must not read them again.
_READ: ContextVar[bool] = ContextVar("accelerate_launch_read", default=False)


@dataclass(frozen=True)
class LaunchEnvironment:
    """The engine ``accelerate launch`` asked for: ``kind`` "FSDP" with its ``strategy``, or "DEEPSPEED" with its
    DeepSpeed config dict (``deepspeed``); ``source`` names the variables in messages."""

    kind: str
    source: str
    strategy: Any = None
    deepspeed: dict[str, Any] | None = None

    def expected_strategy(self) -> Any:
        """The strategy object the launcher asked for (under DeepSpeed, the ZeRO stage of its config)."""
        if self.strategy is not None:
            return self.strategy
        from shardkit.config.deepspeed import build_strategy, strategy_spec_from_deepspeed

        return build_strategy(strategy_spec_from_deepspeed(self.deepspeed or {}, self.source,
                                                           world_size_from_env() or 1))


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() not in _OFF


def refuse_unsupported(environ: Mapping[str, str] | None = None) -> None:
    """Raise NotImplementedError naming the first variable of accelerate launch that shardkit cannot honour."""
    environ = os.environ if environ is None else environ
    for name, why in _REFUSED.items():
        if _flag(environ, name):
            raise NotImplementedError(f"{name}={environ[name]} (set by accelerate launch): {why}")
    backend = environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").strip().upper()
    if backend not in ("", "NO"):
        raise NotImplementedError(f"ACCELERATE_DYNAMO_BACKEND={backend} (set by accelerate launch from dynamo_config): "
                                  f"shardkit does not compile the model for you; call torch.compile(model) in the "
                                  f"script and set dynamo_backend: 'NO'")


def launch_environment(mixed_precision: str = "no", environ: Mapping[str, str] | None = None
                       ) -> LaunchEnvironment | None:
    """The FSDP strategy or DeepSpeed config that accelerate launch's variables ask for; None when they ask for none.

    Args:
        mixed_precision: "no", "fp16" or "bf16": fills the DeepSpeed config's precision section, as Accelerate does.
        environ: the variables (default ``os.environ``).

    Raises:
        ConfigError: a variable's value is wrong (named), or FSDP and DeepSpeed are both asked for.
        NotImplementedError: a variable asks for what shardkit cannot do (named).
    """
    environ = os.environ if environ is None else environ
    refuse_unsupported(environ)
    # NOTE: accelerate launch writes FSDP_VERSION with every FSDP launch. ACCELERATE_USE_FSDP alone is the hint an
    # FSDP plugin built in this process exports for transformers' from_pretrained (shardkit's FSDP with
    # cpu_ram_efficient_loading, Accelerate's Accelerator(fsdp_plugin=...)): it asks no later Accelerator for FSDP.
    # Likewise accelerate launch writes ACCELERATE_CONFIG_DS_FIELDS with every DeepSpeed launch, while Accelerate's
    # Accelerator(deepspeed_plugin=...) leaves ACCELERATE_USE_DEEPSPEED=true alone behind in its process.
    fsdp = _flag(environ, "ACCELERATE_USE_FSDP") and "FSDP_VERSION" in environ
    deepspeed = _deepspeed_launch(environ)
    if fsdp and deepspeed:
        raise ConfigError("ACCELERATE_USE_FSDP and ACCELERATE_USE_DEEPSPEED are both set: the job asks for two "
                          "engines; launch with one config (distributed_type: FSDP or DEEPSPEED)")
    if fsdp:
        return _fsdp(environ)
    if deepspeed:
        return _deepspeed(environ, mixed_precision)
    return None


def from_accelerate_launch(mixed_precision: str = "no") -> LaunchEnvironment | None:
    """:func:`launch_environment` of this process, but None under ``shardkit launch`` (its ranks read the YAML file
    itself, named by ``SHARDKIT_CONFIG_FILE``)."""
    if os.environ.get(CONFIG_FILE_ENV) is not None or _READ.get():
        return None
    return launch_environment(mixed_precision)


def asks_for_deepspeed() -> bool:
    """Whether accelerate launch's variables ask this process for DeepSpeed (cheap: nothing is translated)."""
    return _deepspeed_launch(os.environ) and os.environ.get(CONFIG_FILE_ENV) is None


def _deepspeed_launch(environ: Mapping[str, str]) -> bool:
    return _flag(environ, "ACCELERATE_USE_DEEPSPEED") and "ACCELERATE_CONFIG_DS_FIELDS" in environ


@contextmanager
def launcher_read() -> Iterator[None]:
    """Inside it :func:`from_accelerate_launch` answers None: a front that has reconciled the launcher's variables
    with its own arguments builds its Runner from the result."""
    token = _READ.set(True)
    try:
        yield
    finally:
        _READ.reset(token)


def reconcile_strategy(launched: LaunchEnvironment, strategy: Any, who: str) -> Any:
    """The strategy a script runs when ``accelerate launch`` asked for ``launched``: the launcher's when ``strategy``
    is None; ``strategy`` itself when it is of the class the launcher asked for (its settings win, as an Accelerate
    plugin argument does, with one warning when they differ from the launcher's).

    Raises:
        ConfigMismatchError: ``strategy`` is of another class (``who`` names where it came from): the job would
            silently train another way than it was launched.
    """
    expected = launched.expected_strategy()
    if strategy is None:
        return expected
    name, asked = type(strategy).__name__, type(expected).__name__
    if type(strategy) is not type(expected):
        raise ConfigMismatchError(
            f"{launched.source} asks for {asked} but {who} is {name}: the job would train {name}, not what it was "
            f"launched with. Drop {who} to train {asked} as launched, or launch without the {launched.kind} config "
            f"(an accelerate config with distributed_type: MULTI_GPU / MULTI_CPU, or unset the variable)")
    ours, theirs = getattr(strategy, "settings", None), getattr(expected, "settings", None)
    if ours != theirs:
        warn_once(f"launch-env-settings:{who}", f"{who} ({ours}) is used; the {asked} settings of {launched.source} "
                                                f"({theirs}) are not (the script's own settings win, as in Accelerate)")
    return strategy


def _fsdp(environ: Mapping[str, str]) -> LaunchEnvironment:
    from shardkit.config.deepspeed import build_strategy
    from shardkit.config.fsdp_options import fsdp_spec

    where = "accelerate launch's environment (ACCELERATE_USE_FSDP=true)"
    section = {key: environ[name] for name, key in FSDP_ENV.items()
               if name in environ and environ[name] != _LAUNCHER_DEFAULTS.get(name)}
    labels = {key: name for name, key in FSDP_ENV.items()}
    spec = fsdp_spec(section, where, labels=labels)
    return LaunchEnvironment("FSDP", where, strategy=build_strategy(spec))


def _deepspeed(environ: Mapping[str, str], mixed_precision: str) -> LaunchEnvironment:
    from shardkit.config.accelerate import deepspeed_config_from_section

    file = environ.get(CONFIG_FILE_VAR, "").strip()
    given = {name: environ[name] for name in DEEPSPEED_ENV if environ.get(name, "").strip()}
    if file and file.lower() != "none":
        where = f"{CONFIG_FILE_VAR}={file} (set by accelerate launch)"
        inline = sorted(n for n in given if n not in ("ACCELERATE_DEEPSPEED_ZERO3_INIT",
                                                      "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"))
        if inline:
            raise ConfigError(f"{where} and also {inline}: with deepspeed_config_file the DeepSpeed settings go in "
                              f"the JSON file; remove them from the accelerate config")
        path = Path(file)  # as Accelerate opens it: relative to the directory the script runs in
        if not path.is_file():
            raise ConfigError(f"{where}: {str(path.resolve())!r} is not a file; fix deepspeed_config_file (a relative "
                              f"path starts at the directory accelerate launch ran in)")
        return LaunchEnvironment("DEEPSPEED", where, deepspeed=load_mapping(path))
    where = "accelerate launch's environment (ACCELERATE_USE_DEEPSPEED=true)"
    section = {DEEPSPEED_ENV[name]: _value(name, text) for name, text in given.items()}
    try:
        config = deepspeed_config_from_section(section, mixed_precision, where)
    except ConfigError as err:
        raise ConfigError(_with_variables(str(err))) from None
    return LaunchEnvironment("DEEPSPEED", where, deepspeed=config)


def _value(name: str, text: str) -> Any:
    """A variable's text as the YAML value it was written from (numbers, true/false, else the text)."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "auto":
        return "auto"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    if name in ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                "ACCELERATE_GRADIENT_CLIPPING"):
        raise ConfigError(f"{name}={text!r} (set by accelerate launch) must be a number")
    return text


def _with_variables(message: str) -> str:
    """A translator's message with each ``deepspeed_config.<key>`` named by its variable."""
    for name, key in DEEPSPEED_ENV.items():
        message = message.replace(f"deepspeed_config.{key}", name)
    return message
