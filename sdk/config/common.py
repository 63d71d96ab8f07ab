"""Pieces shared by the DeepSpeed and Accelerate readers: errors, key checking, the resolved result."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.suggest import did_you_mean

__all__ = [
    "AUTO",
    "CONFIG_FILE_ENV",
    "ConfigError",
    "ConfigKeyError",
    "ConfigMismatchError",
    "ConfigResourceError",
    "ResolvedConfig",
    "check_known_keys",
    "check_number",
    "load_mapping",
    "precision_kind",
    "reconcile",
    "warn_once",
    "world_size_from_env",
]

log = logging.getLogger("shardkit.config")
_WARNED: set[str] = set()

AUTO = "auto"
# Set by `shardkit launch --config_file` (the config's absolute path): a Runner built without arguments in
# the launched script takes its strategy and precision from this file.
CONFIG_FILE_ENV = "SHARDKIT_CONFIG_FILE"


class ConfigError(ValueError):
    """A config file (or dict) cannot be used as written; the message names the key and the fix."""


class ConfigKeyError(ConfigError):
    """A key that no known section has (DeepSpeed and Accelerate ignore these; shardkit does not)."""


class ConfigMismatchError(ConfigError):
    """The config and the Runner both set a value, to different things."""


class ConfigResourceError(ConfigError):
    """The config asks for more processes, devices or machines than exist."""


@dataclass(frozen=True)
class ResolvedConfig:
    """What a config file means for a Runner, with every "auto" settled that can be settled.

    Attributes:
        strategy: the Strategy object the config asks for.
        precision: the Precision object the config asks for.
        gradient_accumulation_steps: micro-batches per optimizer step (1 when nothing set it).
        micro_batch_size: samples per rank per micro-batch, or None when only the data loader knows it.
        max_grad_norm: clip gradients to this total norm, or None for no clipping.
        optimizer: ``{"type": "AdamW", "params": {...}}`` with DeepSpeed's names, or None.
        scheduler: ``{"type": "WarmupLR", "params": {...}}`` with DeepSpeed's names, or None.
        source: where the settings came from (the file path, or "dict").
        ignored_keys: dotted keys accepted but not acted on (logging, profiling, ...).
    """

    strategy: Any
    precision: Any
    gradient_accumulation_steps: int
    micro_batch_size: int | None
    max_grad_norm: float | None
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    source: str
    ignored_keys: tuple[str, ...] = ()
    activation_checkpointing: Any = None  # shardkit.strategies.ActivationCheckpointing from a DeepSpeed section


def precision_kind(precision: Any) -> str:
    """"fp16", "bf16" or "fp32": a Precision's compute dtype as both config formats name it."""
    import torch

    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(precision.compute_dtype, "fp32")


def check_known_keys(section: Mapping[str, Any], known: Iterable[str], path: str, source: str) -> None:
    """Raise ConfigKeyError listing every key of ``section`` not in ``known``, each with its closest valid key."""
    known = list(known)
    problems = []
    for key in section:
        if key in known:
            continue
        dotted = f"{path}.{key}" if path else str(key)
        hint = did_you_mean(str(key), known, prefix=f"{path}." if path else "") or f"; valid keys here: {sorted(known)}"
        problems.append(f"unknown key {dotted!r} in {source}{hint}")
    if problems:
        raise ConfigKeyError("\n".join(problems))


def reconcile(name: str, file_value: Any, file_where: str, runner_value: Any, runner_where: str) -> Any:
    """One setting given in two places: the explicit one wins; both explicit and different is an error.

    ``file_value`` is None or "auto" when the file leaves it open; ``runner_value`` None when not given.
    """
    file_open = file_value is None or file_value == AUTO
    if file_open:
        return runner_value
    if runner_value is None or _same(file_value, runner_value):
        return file_value
    raise ConfigMismatchError(f"{name}: {file_value!r} in {file_where} but {runner_value!r} from {runner_where}; "
                              f"set it in one place or make them agree")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def warn_once(key: str, message: str) -> None:
    """Log `message` as a warning the first time `key` is seen in this process (a key with no effect)."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s", message)


def check_number(value: Any, key: str, where: str, *, integer: bool = False, minimum: float | None = None,
                 maximum: float | None = None, above: float | None = None) -> float | int:
    """`value` if it is a finite number in range, else ConfigError naming the key, the value and the range.

    Args:
        integer: whole numbers only (2.0 is accepted as 2).
        minimum, maximum: inclusive bounds; above: exclusive lower bound.
    """
    kind = "a whole number" if integer else "a number"
    bounds = [f">= {minimum:g}" if minimum is not None else "", f"> {above:g}" if above is not None else "",
              f"<= {maximum:g}" if maximum is not None else ""]
    wanted = f"{kind} {' and '.join(b for b in bounds if b)}".strip()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} in {where} must be {wanted}, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} in {where} must be {wanted} (NaN and infinity are not numbers here; "
                          f"a JSON 1e400 reads as infinity)")
    if integer and float(value) != int(value):
        raise ConfigError(f"{key}={value!r} in {where} must be {wanted}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum) or \
            (above is not None and value <= above):
        raise ConfigError(f"{key}={value!r} in {where} must be {wanted}")
    return int(value) if integer else value


def load_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON or YAML file into a dict, naming the file on a read, decode or parse error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                          f"{err.start}); save it as UTF-8") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:  # json.JSONDecodeError / yaml.YAMLError: both say where
        detail = " ".join(str(err).split())  # one line: YAML's messages span several
        raise ConfigError(f"cannot parse {path}: {detail}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, not {type(data).__name__}")
    return data


def world_size_from_env() -> int | None:
    """WORLD_SIZE as a launcher set it, or None outside a launched job."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None
