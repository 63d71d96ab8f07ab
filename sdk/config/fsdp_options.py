"""FSDP options as Accelerate and transformers spell them, translated in one place into ``FSDP(...)`` settings.

Three sources read through here: an Accelerate YAML's ``fsdp_config:`` section (``fsdp_``-prefixed keys),
``accelerate launch``'s ``--fsdp_*`` flags (the same keys), and the Trainer's ``fsdp=`` / ``fsdp_config=`` (keys
with or without the prefix, as transformers strips it; FSDP1 and FSDP2 spellings alike). Every key is honoured,
or has no effect under torch FSDP2 and says so once by name, or is refused by name with the closest valid key.

    from shardkit.config.fsdp_options import fsdp_spec
    name, kwargs = fsdp_spec({"fsdp_sharding_strategy": "FULL_SHARD"}, "fsdp.yaml")   # ("FSDP", {...})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardkit.config.common import ConfigError, check_known_keys, config_bool, warn_once
from shardkit.config.deepspeed import StrategySpec
from shardkit.utils.suggest import did_you_mean

__all__ = ["FSDP_KEYS", "FSDP_OPTIONS", "TRAINER_FSDP_DEFAULTS", "fsdp_spec", "trainer_fsdp_spec"]

# Every option, without the "fsdp_" prefix that Accelerate's YAML and flags put on them.
FSDP_OPTIONS = ("version", "sharding_strategy", "reshard_after_forward", "auto_wrap_policy",
                "transformer_layer_cls_to_wrap", "min_num_params", "offload_params", "cpu_offload", "state_dict_type",
                "sync_module_states", "cpu_ram_efficient_loading", "activation_checkpointing", "backward_prefetch",
                "backward_prefetch_policy", "forward_prefetch", "use_orig_params", "limit_all_gathers", "xla",
                "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")
FSDP_KEYS = tuple(f"fsdp_{k}" for k in FSDP_OPTIONS)  # Accelerate's YAML keys
# transformers' Trainer defaults to FSDP2. NOTE: its FULL_STATE_DICT default is not taken: it names how HF's Trainer
# writes its checkpoints, while shardkit's keep sharded exact-resume state and save_model() writes HF weights anyway.
TRAINER_FSDP_DEFAULTS = {"version": 2}

_SHARDING = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad_op", "NO_SHARD": "none", "HYBRID_SHARD": "hybrid",
             "HYBRID_SHARD_ZERO2": "hybrid_zero2", 1: "full", 2: "grad_op", 3: "none", 4: "hybrid",
             5: "hybrid_zero2"}
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_STATE_DICT = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
_DEFAULT_MIN_NUM_PARAMS = 100_000_000  # Accelerate's fsdp_min_num_params default (1e8)
# The Trainer's legacy fsdp="full_shard offload auto_wrap" words.
_TRAINER_WORDS = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "hybrid_shard": "HYBRID_SHARD",
                  "hybrid_shard_zero2": "HYBRID_SHARD_ZERO2", "no_shard": "NO_SHARD"}


class _Options:
    """A section with its keys unprefixed; errors name each key as the user wrote it."""

    def __init__(self, section: Mapping[str, Any], where: str, path: str, labels: Mapping[str, str] | None = None):
        self.where, self.path, self.values, self.spelled = where, path, {}, {}
        self.labels = dict(labels or {})
        self.prefix = "fsdp_" if any(str(k).startswith("fsdp_") for k in section) else ""
        check_known_keys(section, (*FSDP_OPTIONS, *FSDP_KEYS), path, where)
        for key, value in section.items():
            name = key[5:] if key.startswith("fsdp_") else key
            if name in self.values and self.values[name] != value:
                raise ConfigError(f"{path}: {self.spelled[name]}={self.values[name]!r} and {key}={value!r} in {where} "
                                  f"name one option twice with different values; keep one")
            self.values[name], self.spelled[name] = value, key

    def key(self, key: str) -> str:
        return self.spelled.get(key, self.prefix + key)

    def name(self, key: str) -> str:
        """The option as the user gave it: a flag or variable named in ``labels``, else ``<path>.<key>``."""
        return self.labels.get(self.key(key)) or f"{self.path}.{self.key(key)}"

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def flag(self, key: str, default: bool) -> bool:
        return config_bool(self.values.get(key, default), self.name(key), self.where)


def fsdp_spec(section: Mapping[str, Any], where: str, path: str = "fsdp_config",
              defaults: Mapping[str, Any] | None = None, labels: Mapping[str, str] | None = None) -> StrategySpec:
    """``("FSDP", kwargs)`` for an FSDP options mapping (keys with or without the ``fsdp_`` prefix).

    Args:
        section: the options; ``defaults`` fill the keys it leaves out (Accelerate's when None).
        where: names the source in errors (a file path, "TrainingArguments.fsdp_config", ...).
        path: the section's name in errors.
        labels: key (as spelled in ``section``) -> the name errors give it instead of ``<path>.<key>``: the
            launch flag or environment variable the value came from.

    Raises:
        ConfigKeyError: an unknown key (with the closest valid one).
        ConfigError: a bad value or a contradiction (both named).
        NotImplementedError: an option FSDP2 cannot honour here (XLA, LOCAL_STATE_DICT).
    """
    if not isinstance(section, Mapping):
        raise ConfigError(f"{path} in {where} must be a mapping of FSDP options, not {type(section).__name__}")
    options = _Options({**{k: v for k, v in (defaults or {}).items() if not _given(section, k)}, **section}, where,
                       path, labels)
    kwargs: dict[str, Any] = {}
    sharding = _sharding(options)
    if sharding == "hybrid_zero2":
        sharding, kwargs["reshard_after_forward"] = "hybrid", False
    kwargs["sharding"] = sharding
    if isinstance(options.get("reshard_after_forward"), bool):
        kwargs["reshard_after_forward"] = options.get("reshard_after_forward")
    kwargs["auto_wrap"] = _auto_wrap(options)
    state = options.get("state_dict_type", "SHARDED_STATE_DICT")
    if not isinstance(state, str) or state.upper() not in _STATE_DICT:
        raise (NotImplementedError if str(state).upper() == "LOCAL_STATE_DICT" else ConfigError)(
            f"{options.name('state_dict_type')}: {state!r} in {where}; use one of {list(_STATE_DICT)}")
    kwargs["state_dict_type"] = _STATE_DICT[state.upper()]
    kwargs["cpu_offload"] = options.flag("offload_params", False) or options.flag("cpu_offload", False)
    kwargs["activation_checkpointing"] = options.flag("activation_checkpointing", False)
    sync = options.flag("sync_module_states", True)
    if options.flag("cpu_ram_efficient_loading", False) and not sync:
        raise ConfigError(f"{options.name('cpu_ram_efficient_loading')}: true needs "
                          f"{options.key('sync_module_states')}: true (only rank 0 loads the weights; the others "
                          f"receive them) in {where}")
    kwargs["sync_module_states"] = sync
    if options.flag("cpu_ram_efficient_loading", False):  # named only when asked for (the FSDP default is off)
        kwargs["cpu_ram_efficient_loading"] = True
    version = options.get("version", 1)
    if isinstance(version, str) and version.isdigit():
        version = int(version)
    if isinstance(version, bool) or not isinstance(version, int) or version not in (1, 2):
        raise ConfigError(f"{options.name('version')}: {version!r} in {where} must be 1 or 2")
    _no_effect(options)
    return "FSDP", kwargs


def trainer_fsdp_spec(fsdp: Any, fsdp_config: Mapping[str, Any] | None) -> StrategySpec:
    """``("FSDP", kwargs)`` for the Trainer's ``fsdp=`` (True, or the legacy words "full_shard offload auto_wrap")
    and ``fsdp_config=`` (a dict already read from its JSON), with transformers' defaults."""
    config = dict(fsdp_config or {})
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else []
    for word in words:
        if word in _TRAINER_WORDS:
            if not _given(config, "sharding_strategy") and not _given(config, "reshard_after_forward"):
                config["sharding_strategy"] = _TRAINER_WORDS[word]
        elif word == "offload":
            config.setdefault("cpu_offload", True)
        elif word != "auto_wrap":
            options = [*_TRAINER_WORDS, "offload", "auto_wrap"]
            raise ConfigError(f"TrainingArguments.fsdp: unknown option {word!r}{did_you_mean(str(word), options)}; "
                              f"use {options}")
    return fsdp_spec(config, "TrainingArguments.fsdp_config", "fsdp_config", TRAINER_FSDP_DEFAULTS)


def _given(section: Mapping[str, Any], key: str) -> bool:
    return key in section or f"fsdp_{key}" in section


def _sharding(options: _Options) -> str:
    value = options.get("sharding_strategy", "FULL_SHARD")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        # NOTE: 1.7 used to become FULL_SHARD through int(); [1] raised a bare TypeError.
        raise ConfigError(f"{options.name('sharding_strategy')}: {value!r} in {options.where} must be a name like "
                          f"'FULL_SHARD' or a whole number 1-5")
    reshard = options.get("reshard_after_forward")
    if isinstance(reshard, str) and reshard.lower() not in ("true", "false"):  # FSDP1 spelling: a strategy name
        if options.get("sharding_strategy") is not None and reshard.upper() != str(value).upper():
            raise ConfigError(f"{options.path}: {options.key('reshard_after_forward')} {reshard!r} and "
                              f"{options.key('sharding_strategy')} {value!r} disagree in {options.where}; keep one")
        value = reshard
    elif isinstance(reshard, str):
        options.values["reshard_after_forward"] = reshard.lower() == "true"
    key = value.upper() if isinstance(value, str) and not value.isdigit() else int(value)
    if key not in _SHARDING:
        names = [k for k in _SHARDING if isinstance(k, str)]
        raise ConfigError(f"{options.name('sharding_strategy')}: {value!r} in {options.where}"
                          f"{did_you_mean(str(value), names)}; use one of {names} or 1-5")
    return _SHARDING[key]


def _auto_wrap(options: _Options) -> Any:
    policy = options.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy not in _WRAP_POLICIES:
        raise ConfigError(f"{options.name('auto_wrap_policy')}: {policy!r} in {options.where}"
                          f"{did_you_mean(str(policy), _WRAP_POLICIES)}; use one of {list(_WRAP_POLICIES)}")
    min_params = options.get("min_num_params")
    if policy == "SIZE_BASED_WRAP" or (min_params and "auto_wrap_policy" not in options.values):
        return _positive_int(options, "min_num_params", _DEFAULT_MIN_NUM_PARAMS)
    if policy == "NO_WRAP":
        return False  # FSDP(auto_wrap=False): only the root is sharded
    names = options.get("transformer_layer_cls_to_wrap")
    if names is None or (isinstance(names, (list, tuple)) and not names):
        return None  # FSDP finds the repeated blocks itself (the role of Accelerate's _no_split_modules)
    items = names if isinstance(names, (list, tuple)) else str(names).split(",")
    wrapped = tuple(str(n).strip() for n in items)
    if not all(wrapped):
        # NOTE: Accelerate looks an empty name up in the model and fails; silently wrapping the blocks FSDP finds
        # instead would run a layout nobody asked for.
        raise ConfigError(f"{options.name('transformer_layer_cls_to_wrap')}: {names!r} in {options.where} has an "
                          f"empty class name; name the blocks to wrap (e.g. LlamaDecoderLayer, comma-separated), or "
                          f"leave the option out to wrap the model's repeated blocks")
    return wrapped


def _positive_int(options: _Options, key: str, default: int) -> int:
    value = options.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{options.name(key)}: {value!r} in {options.where} must be a whole number >= 1")
    return value


def _no_effect(options: _Options) -> None:
    """Refuse what cannot run here; warn once for each FSDP1 knob that asks for something FSDP2 does not do."""
    where = options.where
    for key in ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):
        if options.flag(key, False):
            raise NotImplementedError(f"{options.name(key)}: true in {where}: XLA's FSDP runs on TPUs; shardkit runs "
                                      f"torch FSDP2 (drop the key)")
    for key in ("backward_prefetch", "backward_prefetch_policy"):
        value = options.get(key)
        if value is not None and (not isinstance(value, str) or value.upper() not in _PREFETCH):
            raise ConfigError(f"{options.name(key)}: {value!r} in {where}; use one of {list(_PREFETCH)}")
        if value is not None and value.upper() != "BACKWARD_PRE":
            warn_once(f"fsdp:{key}", f"{where}: {options.name(key)}: {value} has no effect: FSDP2 always "
                      f"prefetches the next block's all-gather in backward (BACKWARD_PRE); for another order call "
                      f"module.set_modules_to_backward_prefetch([...]) on the sharded blocks after runner.setup()")
    if options.flag("forward_prefetch", False):
        warn_once("fsdp:forward_prefetch", f"{where}: {options.name('forward_prefetch')}: true has no effect: FSDP2 "
                  f"overlaps the next all-gather implicitly; for explicit forward prefetching call "
                  f"module.set_modules_to_forward_prefetch([...]) on the sharded blocks after runner.setup()")
    if not options.flag("use_orig_params", True):
        warn_once("fsdp:use_orig_params", f"{where}: {options.name('use_orig_params')}: false has no effect: FSDP2 "
                  f"always keeps the original parameters (as DTensor shards); remove the key")
    if not options.flag("limit_all_gathers", True):
        warn_once("fsdp:limit_all_gathers", f"{where}: {options.name('limit_all_gathers')}: false has no effect: "
                  f"FSDP2 bounds its in-flight all-gathers itself; remove the key")
    if options.get("xla_fsdp_settings"):
        raise NotImplementedError(f"{options.name('xla_fsdp_settings')} in {where}: XLA's FSDP runs on TPUs; shardkit "
                                  f"runs torch FSDP2 (drop the key)")
