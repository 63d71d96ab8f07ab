"""HfArgumentParser: dataclasses from ``--flags``, a dict, or a JSON/YAML file (Hugging Face's spelling).

transformers' own ``HfArgumentParser`` reads shardkit's TrainingArguments and SFTConfig too, with the same
values (their annotations are ones it understands), so an HF script's parser line runs unchanged. This one
needs no transformers and names the fix for a removed or misspelt flag where transformers' lists it as unused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shardkit.trainer.argument_errors import OBSOLETE_ARGUMENTS
from shardkit.utils.suggest import did_you_mean

__all__ = ["HfArgumentParser"]


def _parse_bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "y", "t"):
        return True
    if lowered in ("0", "false", "no", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # a path (deepspeed=ds.json) or a plain word (fsdp="full_shard auto_wrap")


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the non-None type, whether it is a list) of a field's annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if any(typing.get_origin(a) is dict or a is dict for a in args):
            return dict, False
        if any(typing.get_origin(a) is list for a in args) and len(args) == 1:
            return _unwrap(args[0])
        if len(args) == 1:
            return _unwrap(args[0])
        return str, False  # e.g. str | list[str]: parsed as text
    if origin is list:
        inner = typing.get_args(annotation)
        return (inner[0] if inner else str), True
    if origin is dict:
        return dict, False
    return annotation, False


class HfArgumentParser(argparse.ArgumentParser):
    """An argparse parser built from dataclasses' fields.

    Example:
        parser = HfArgumentParser((ModelArguments, TrainingArguments))
        model_args, training_args = parser.parse_args_into_dataclasses()
        (training_args,) = HfArgumentParser(TrainingArguments).parse_file("args.yaml")

    Booleans accept ``--fp16`` or ``--fp16 true``, and ``--no_<name>`` when the default is True;
    dict fields take JSON text.
    """

    def __init__(self, dataclass_types: type | Iterable[type], **kwargs: Any):
        super().__init__(**kwargs)
        self.dataclass_types = [dataclass_types] if isinstance(dataclass_types, type) else list(dataclass_types)
        for dtype in self.dataclass_types:
            hints = typing.get_type_hints(dtype)
            for item in dataclasses.fields(dtype):
                if item.init:
                    self._add_field(item, hints[item.name])

    def _add_field(self, item: dataclasses.Field, annotation: Any) -> None:
        kind, is_list = _unwrap(annotation)
        default = item.default
        if default is dataclasses.MISSING and item.default_factory is not dataclasses.MISSING:
            default = item.default_factory()
        kwargs: dict[str, Any] = {"default": default, "dest": item.name}
        if default is dataclasses.MISSING:
            kwargs.pop("default")
            kwargs["required"] = True
        names = [f"--{item.name}"] + ([f"--{item.name.replace('_', '-')}"] if "_" in item.name else [])
        if kind is bool:
            kwargs.update(type=_parse_bool, nargs="?", const=True)
            self.add_argument(*names, **kwargs)
            if default is True:
                self.add_argument(f"--no_{item.name}", action="store_false", dest=item.name)
            return
        if kind is dict:
            kwargs["type"] = _parse_json
        elif kind in (int, float, str):
            kwargs["type"] = kind
        if is_list:
            kwargs["nargs"] = "+"
        self.add_argument(*names, **kwargs)

    def parse_args_into_dataclasses(self, args: list[str] | None = None,
                                    return_remaining_strings: bool = False) -> tuple[Any, ...]:
        """One instance per dataclass from ``args`` (``sys.argv[1:]`` by default).

        A single argument ending in .json/.yaml/.yml is read as a file of values.
        """
        args = sys.argv[1:] if args is None else list(args)
        if len(args) == 1 and Path(args[0]).suffix.lower() in (".json", ".yaml", ".yml"):
            return self.parse_file(args[0])
        namespace, remaining = self.parse_known_args(args)
        if remaining and not return_remaining_strings:
            raise _unknown_flags(remaining, self._flag_names())
        outputs = self._build(vars(namespace))
        return (*outputs, remaining) if return_remaining_strings else tuple(outputs)

    def parse_dict(self, values: Mapping[str, Any], allow_extra_keys: bool = False) -> tuple[Any, ...]:
        """One instance per dataclass from a mapping of field names to values."""
        known = {f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype)}
        unknown = sorted(set(values) - known)
        if unknown and not allow_extra_keys:

            # One line per key, as the config readers do, so each hint sits beside its own key.
            lines = [f"argument {k!r}: {OBSOLETE_ARGUMENTS[k]}" if k in OBSOLETE_ARGUMENTS else
                     f"unknown argument {k!r}{did_you_mean(k, known)}" for k in unknown]
            raise ValueError("\n".join(lines) + "\nremove or rename them")
        return tuple(self._build(values, defaults=False))

    def parse_json_file(self, path: str | Path, allow_extra_keys: bool = False) -> tuple[Any, ...]:
        return self.parse_dict(_read_mapping(Path(path)), allow_extra_keys)

    def parse_yaml_file(self, path: str | Path, allow_extra_keys: bool = False) -> tuple[Any, ...]:
        return self.parse_dict(_read_mapping(Path(path)), allow_extra_keys)

    def parse_file(self, path: str | Path, allow_extra_keys: bool = False) -> tuple[Any, ...]:
        """A JSON (``.json``) or YAML (``.yaml``/``.yml``) file of field values."""
        suffix = Path(path).suffix.lower()
        if suffix == ".json":
            return self.parse_json_file(path, allow_extra_keys)
        if suffix in (".yaml", ".yml"):
            return self.parse_yaml_file(path, allow_extra_keys)
        raise ValueError(f"{path}: arguments files must end in .json, .yaml or .yml")

    def _flag_names(self) -> list[str]:
        return [f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype) if f.init]

    def _build(self, values: Mapping[str, Any], defaults: bool = True) -> list[Any]:
        outputs = []
        for dtype in self.dataclass_types:
            names = {f.name for f in dataclasses.fields(dtype) if f.init}
            kwargs = {k: v for k, v in values.items() if k in names}
            outputs.append(dtype(**kwargs))
        return outputs


def _unknown_flags(remaining: list[str], known: list[str]) -> ValueError:
    """The first unknown flag, with what replaced it (a name transformers removed) or the closest flag."""

    flags = [r for r in remaining if r.startswith("--")]
    if not flags:
        return ValueError(f"unexpected command-line values {remaining}; run with --help for the valid flags")
    lines = []
    for flag in flags:
        name = flag[2:].split("=", 1)[0].replace("-", "_")
        if name in OBSOLETE_ARGUMENTS:
            lines.append(f"--{name}: {OBSOLETE_ARGUMENTS[name]}")
        else:
            lines.append(f"unknown command-line flag --{name}{did_you_mean(name, known, prefix='--')}")
    return ValueError("\n".join(lines) + "\n(run with --help for the valid flags)")


def _read_mapping(path: Path) -> dict[str, Any]:
    """An arguments file through the config files' reader: a regular file of at most ``MAX_CONFIG_BYTES``, UTF-8,
    JSON (``.json``) or YAML (a superset of JSON), no key written twice, a mapping (ConfigError names the file)."""
    from shardkit.config.common import load_mapping

    if not path.exists():
        raise FileNotFoundError(f"arguments file {path} does not exist")
    return load_mapping(path)
