"""Pieces shared by the DeepSpeed and Accelerate readers: errors, key checking, the resolved result."""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.utils.suggest import did_you_mean

__all__ = [
    "AUTO",
    "CONFIG_FILE_ENV",
    "ConfigError",
    "ConfigKeyError",
    "ConfigMismatchError",
    "ConfigResourceError",
    "MAX_CONFIG_BYTES",
    "ResolvedConfig",
    "check_known_keys",
    "check_number",
    "config_bool",
    "is_main_process",
    "load_mapping",
    "precision_kind",
    "read_config_bytes",
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
    trackers: tuple[Any, ...] = ()  # shardkit.observability.trackers.TrackerSpec per enabled DeepSpeed monitor section


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


def config_bool(value: Any, key: str, where: str) -> bool:
    """A config's boolean: true/false, or the strings "true"/"false" (any case) that YAML, JSON and flags give."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} in {where} must be true or false")
    return value


def warn_once(key: str, message: str) -> None:
    """Log `message` as a warning the first time `key` is seen, on the job's main process only (every rank reads the
    same settings, so one note per run is enough: a key with no effect)."""
    if key not in _WARNED:
        _WARNED.add(key)
        if is_main_process():
            log.warning("%s", message)


def is_main_process() -> bool:
    """True on global rank 0: the process group's rank once it exists, else the launcher's ``RANK``."""
    import sys

    dist = sys.modules.get("torch.distributed")  # never imported here for this: the group exists only if it was
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    rank = os.environ.get("RANK", "0").strip()
    return not rank.isdigit() or int(rank) == 0


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


# NOTE: the largest DeepSpeed/Accelerate config seen in the corpus is 9 KB; 4 MiB leaves room and still
# refuses /dev/zero or a log passed by mistake before it fills memory.
MAX_CONFIG_BYTES = 4 * 2**20


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int | None = None) -> None:
        super().__init__(key)
        self.key, self.line = key, line


def read_config_bytes(path: str | os.PathLike, what: str = "config file") -> bytes:
    """The bytes of a small regular file: a FIFO, device (``/dev/zero``) or huge file is refused, never read.

    Raises:
        ConfigError: naming the file: missing, not a regular file, over :data:`MAX_CONFIG_BYTES`, unreadable.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} not found") from None
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file (a directory, FIFO or device such as /dev/zero "
                              f"is never read); pass the path of the file itself")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{what} {path} is {st.st_size} bytes; a config is at most {MAX_CONFIG_BYTES} bytes: "
                              f"is it the right file?")
        os.set_blocking(fd, True)
        try:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as err:
            raise ConfigError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} {path} grew past {MAX_CONFIG_BYTES} bytes while being read")
    return raw


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _yaml_loader() -> type:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """yaml.safe_load's loader, refusing a key written twice in one mapping (YAML keeps the last)."""

    def construct_unique(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then overriding a merged key is YAML's intended use
            key = loader.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # an unhashable key: construct_mapping names it
            if duplicate:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_unique)
    return UniqueKeyLoader


def _parse(text: str, path: Path) -> Any:
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text, object_pairs_hook=_unique_json_object)
        import yaml

        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as dup:
        key = dup.key if isinstance(dup.key, (str, int, float, bool)) else type(dup.key).__name__
        line = f" (second time on line {dup.line})" if dup.line else ""
        raise ConfigError(f"key {str(key)[:80]!r} is written twice in one section of {path}{line}; JSON and YAML "
                          f"readers keep the last value silently, so shardkit refuses: keep the one you mean") from None
    except RecursionError:
        raise ConfigError(f"cannot parse {path}: nested too deeply") from None
    except Exception as err:  # json.JSONDecodeError / yaml.YAMLError: both say where
        detail = " ".join(str(err).split())[:400]  # one line: YAML's messages span several
        raise ConfigError(f"cannot parse {path}: {detail}") from None


def load_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Read a JSON or YAML file into a dict, naming the file on a read, decode or parse error.

    Refused, by name: a file that is not regular or is over :data:`MAX_CONFIG_BYTES`, text that is not UTF-8,
    and a key written twice in one mapping (``"stage": 3`` then ``"stage": 1``).
    """
    path = Path(path)
    raw = read_config_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                          f"{err.start}); save it as UTF-8") from None
    data = _parse(text, path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, not {type(data).__name__}")
    return data


def world_size_from_env() -> int | None:
    """WORLD_SIZE as a launcher set it, or None outside a launched job."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None
