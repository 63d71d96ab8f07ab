"""``accelerate launch``'s config-as-flags on ``shardkit launch``, and the default config ``shardkit config`` writes.

    shardkit launch --use_fsdp --mixed_precision=bf16 --fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP \\
        --fsdp_transformer_layer_cls_to_wrap=LlamaDecoderLayer --fsdp_sharding_strategy=FULL_SHARD train.py

The flags are Accelerate's names. They are laid over the ``--config_file`` YAML (else ``./shardkit_config.yaml``
when it exists, as ``accelerate launch`` reads its default config) into one Accelerate YAML that the launched
ranks read through ``SHARDKIT_CONFIG_FILE``, so that the same checks, translators and errors apply as to a file.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardkit.config.common import ConfigError, load_mapping

__all__ = ["DEEPSPEED_FLAGS", "FSDP_FLAGS", "add_config_flags", "config_from_flags", "write_flags_config"]

FSDP_FLAGS = ("fsdp_version", "fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy",
              "fsdp_reshard_after_forward", "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap",
              "fsdp_backward_prefetch", "fsdp_state_dict_type", "fsdp_forward_prefetch", "fsdp_use_orig_params",
              "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_activation_checkpointing")
DEEPSPEED_FLAGS = ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
                   "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps",
                   "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model")
_SWITCHES = {"use_fsdp": "FSDP", "use_deepspeed": "DEEPSPEED", "multi_gpu": "MULTI_GPU"}
_DEST = "config_flag_"


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Accelerate's launch flags that describe the run (not the processes), each under its own name."""
    group = parser.add_argument_group("config as flags (accelerate launch's names; laid over --config_file)")
    for switch, kind in _SWITCHES.items():
        group.add_argument(f"--{switch}", dest=_DEST + switch, action="store_true",
                           help=f"distributed_type: {kind}")
    group.add_argument("--cpu", dest=_DEST + "cpu", action="store_true", help="use_cpu: true")
    group.add_argument("--mixed_precision", "--mixed-precision", dest=_DEST + "mixed_precision",
                       choices=("no", "fp16", "bf16"), help="mixed_precision")
    for name in (*FSDP_FLAGS, *DEEPSPEED_FLAGS):
        group.add_argument(f"--{name}", dest=_DEST + name, metavar="VALUE", help=f"{name} (as in accelerate launch)")


def config_from_flags(args: argparse.Namespace, base: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The Accelerate config ``base`` becomes with the flags given in ``args`` laid over it; None when none is given."""
    given = _given(args)
    if not given:
        return None
    config: dict[str, Any] = dict(base or {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO"})
    kinds = [kind for switch, kind in _SWITCHES.items() if given.pop(switch, False)]
    if len(kinds) > 1:
        raise ConfigError(f"--use_fsdp, --use_deepspeed and --multi_gpu choose one engine; got {len(kinds)} of them")
    if given.pop("cpu", False):
        config["use_cpu"] = True
        config.setdefault("distributed_type", "MULTI_CPU")
    if kinds:
        config["distributed_type"] = kinds[0]
    if "mixed_precision" in given:
        config["mixed_precision"] = given.pop("mixed_precision")
    fsdp = {k: _scalar(v) for k, v in given.items() if k in FSDP_FLAGS}
    deepspeed = {k: _scalar(v) for k, v in given.items() if k in DEEPSPEED_FLAGS}
    if "deepspeed_config_file" in deepspeed:  # relative to where the command runs, as accelerate launch reads it
        deepspeed["deepspeed_config_file"] = str(Path(str(deepspeed["deepspeed_config_file"])).resolve())
    if fsdp:
        config["fsdp_config"] = {**(config.get("fsdp_config") or {}), **fsdp}
        config.setdefault("distributed_type", "FSDP")
    if deepspeed:
        config["deepspeed_config"] = {**(config.get("deepspeed_config") or {}), **deepspeed}
    return config


def write_flags_config(args: argparse.Namespace, base_path: Path | None, processes: int | None) -> Path | None:
    """Write the flags laid over ``base_path`` to a private temporary YAML (the caller removes it); None without
    flags. ``processes``: the launch's total process count, kept in the file for the ranks' checks."""
    if not _given(args):
        return None
    base = load_mapping(base_path) if base_path is not None else None
    if base is not None and base.get("deepspeed_config", {}).get("deepspeed_config_file"):
        # relative to where the command runs, as accelerate launch takes it (the written YAML lives elsewhere)
        file = Path(str(base["deepspeed_config"]["deepspeed_config_file"]))
        base["deepspeed_config"]["deepspeed_config_file"] = str(file.resolve())
    config = config_from_flags(args, base)
    if config is None:
        return None
    if processes is not None:
        config["num_processes"] = processes
    import yaml

    handle, name = tempfile.mkstemp(prefix="shardkit_launch_flags_", suffix=".yaml")  # named in the ranks' errors
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        yaml.safe_dump(config, out, sort_keys=True)
    path = Path(name)
    try:
        _check_as_flags(path, args, base_path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _check_as_flags(path: Path, args: argparse.Namespace, base_path: Path | None) -> None:
    """The launcher's own checks of the written file, with errors naming the flags (and the base YAML) the values
    came from instead of a temporary file the user never wrote."""
    from shardkit.config.accelerate import launch_args_from_yaml
    from shardkit.distributed.cli import LaunchUsageError

    try:
        launch_args_from_yaml(path)
    except LaunchUsageError as err:
        given = _given(args)
        words = " ".join(f"--{k}" if v is True else f"--{k}={v}" for k, v in given.items())
        origin = f"shardkit launch's flags ({words})" + (f" laid over {base_path}" if base_path else "")
        message = str(err).removeprefix(f"--config-file {path}: ").replace(str(path), origin)
        for key in given:
            for section in ("fsdp_config", "deepspeed_config"):
                message = message.replace(f"{section}.{key}", f"--{key}")
        raise LaunchUsageError(message) from None


def _given(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST) and v not in (None, False)}


def _scalar(text: str) -> Any:
    """A flag's text as YAML would read it: true/false, numbers (1e8 included), else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        return int(number) if kind is float and number.is_integer() else number
    return text
