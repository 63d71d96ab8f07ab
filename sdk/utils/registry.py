"""A registry of named, lazily imported classes: one place per kind (strategies, precisions) for names,
aliases, the class behind each name, its defaults and the options a command line may set.

    STRATEGIES.build("zero3", offload="cpu")                        # ZeRO3(offload="cpu")
    STRATEGIES.build_from_cli("zero3", ["offload=cpu", "overlap_comm=false"])

Classes are named as ``"module:Class"`` and imported on first use, so listing names never imports an
engine (DeepSpeed loads only when a ZeRO class is asked for). Command-line options are read off the
class's constructor: every keyword argument whose type is built from None, bool, int, float, str or
dict (as JSON) can be set as ``key=value``, checked against that type.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from shardkit.utils.operations import json_object
from shardkit.utils.suggest import did_you_mean

__all__ = ["Entry", "Option", "Registry"]

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_KINDS = (type(None), bool, int, float, dict, str)  # the order a value is tried in: "none" before str, ...
_KIND_NAMES = {type(None): "none", bool: "bool", int: "int", float: "float", dict: "JSON object", str: "str"}


def _key(name: str) -> str:
    """Lookup key: case and '-'/'_' do not matter ("ZeRO-Infinity", "zero_infinity", "bf16_mixed")."""
    return str(name).strip().lower().replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Option:
    """One constructor argument a command line may set.

    Attributes:
        name: the keyword argument.
        kinds: the types a value is parsed as, in order (``type(None)``, bool, int, float, dict, str).
        default: the constructor's default (``inspect.Parameter.empty`` when required).
        annotation: the annotation as written, for messages.
    """

    name: str
    kinds: tuple[type, ...]
    default: Any
    annotation: str

    def describe(self) -> str:
        """``"offload: str | None = None"``."""
        default = "" if self.default is inspect.Parameter.empty else f" = {self.default!r}"
        return f"{self.name}: {self.annotation}{default}"

    def parse(self, text: str) -> Any:
        """The value ``text`` stands for, as the first of :attr:`kinds` that reads it; ValueError if none does."""
        low = text.strip().lower()
        for kind in self.kinds:
            if kind is type(None) and low in ("none", "null"):
                return None
            if kind is bool and low in _TRUE + _FALSE:
                return low in _TRUE
            if kind is int:
                number = _number(text)
                if number is not None and float(number).is_integer():
                    return int(number)
            if kind is float and _number(text) is not None:
                return float(_number(text))
            if kind is dict and text.strip().startswith("{"):
                return json_object(text, f"{self.name}={text!r}", f"give a JSON object ({self.describe()})")
            if kind is str:
                return text
        wanted = " or ".join(_KIND_NAMES[k] for k in self.kinds)
        raise ValueError(f"{self.name}={text!r} must be {wanted} ({self.describe()})")


def _number(text: str) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)  # "5e8" for an element count
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered name.

    Attributes:
        name: the canonical name.
        target: ``"module:Class"``, imported on first use.
        aliases: other names that mean the same entry.
        description: one line for help texts.
        defaults: keyword arguments given to the class unless the caller sets them (``tf32`` is
            ``FP32`` with ``tf32=True``).
        options: the keyword arguments a command line may set; None: every one :func:`cli_options` finds.
    """

    name: str
    target: str
    aliases: tuple[str, ...] = ()
    description: str = ""
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: tuple[str, ...] | None = None

    @property
    def class_name(self) -> str:
        """The class part of :attr:`target`."""
        return self.target.partition(":")[2]

    def load(self) -> type:
        """Import the module and return the class."""
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)


class Registry:
    """Names -> classes for one kind of object, each with aliases, defaults and command-line options.

    Args:
        kind: what the entries are, for messages ("strategy", "precision").
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}  # canonical name -> entry, in registration order
        self._keys: dict[str, str] = {}  # lookup key of every name, alias and class name -> canonical name

    # ---- registration ------------------------------------------------------------------------------

    def register(self, name: str, target: str, *, aliases: Iterable[str] = (), description: str = "",
                 defaults: Mapping[str, Any] | None = None, options: Iterable[str] | None = None) -> Entry:
        """Add a name. The class name of ``target`` is accepted as a name too (unless another entry has it).

        Args:
            name: the canonical name (what :meth:`names` lists and help texts show).
            target: ``"module:Class"``; the module is imported only when the class is needed.
            aliases: other spellings users type.
            description: one line for help texts.
            defaults: keyword arguments given unless the caller sets them.
            options: the keyword arguments a command line may set (None: every one with a simple type).

        Raises:
            ValueError: the name or an alias is taken, or ``target`` is not ``"module:Class"``.
        """
        module, sep, cls = target.partition(":")
        if not (module and sep and cls.isidentifier()):
            raise ValueError(f"{self.kind} {name!r}: target {target!r} must be 'module.path:ClassName'")
        entry = Entry(name, target, tuple(aliases), description, dict(defaults or {}),
                      None if options is None else tuple(options))
        for spelling in (name, *entry.aliases):
            taken = self._keys.get(_key(spelling))
            if taken is not None:
                raise ValueError(f"{self.kind} name {spelling!r} (for {name!r}) is already registered for {taken!r}")
        self._entries[name] = entry
        for spelling in (name, *entry.aliases):
            self._keys[_key(spelling)] = name
        self._keys.setdefault(_key(cls), name)  # "ZeRO3", "TensorParallel": as config readers and users spell it
        return entry

    def unregister(self, name: str) -> Entry:
        """Remove the entry ``name`` (any of its spellings) and every spelling of it; returns the entry.

        Raises:
            ValueError: unknown name (as :meth:`canonical`).
        """
        canonical = self.canonical(name)
        entry = self._entries.pop(canonical)
        for key in [k for k, v in self._keys.items() if v == canonical]:
            del self._keys[key]
        for other in self._entries.values():  # a class name another entry shares now points at that entry
            self._keys.setdefault(_key(other.class_name), other.name)
        return entry

    # ---- lookup ------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Canonical names in registration order."""
        return list(self._entries)

    def aliases(self, name: str | None = None) -> list[str]:
        """The aliases of ``name`` (all entries' when None), as registered (class names not included)."""
        entries = self._entries.values() if name is None else [self.entry(name)]
        return [alias for entry in entries for alias in entry.aliases]

    def canonical(self, name: str) -> str:
        """The canonical name for a name, alias or class name.

        Raises:
            ValueError: unknown name (with the closest known one and the list of names).
        """
        found = self._keys.get(_key(name)) if isinstance(name, str) else None
        if found is None:
            known = [*self.names(), *self.aliases()]
            hint = did_you_mean(_key(name), known) if isinstance(name, str) else ""
            raise ValueError(f"unknown {self.kind} {name!r}{hint or '.'} Known: {', '.join(self.names())} "
                             f"(aliases: {', '.join(self.aliases())})")
        return found

    def entry(self, name: str) -> Entry:
        """The :class:`Entry` for a name, alias or class name (ValueError if unknown)."""
        return self._entries[self.canonical(name)]

    def get_class(self, name: str) -> type:
        """The class behind a name (imports its module now)."""
        return self.entry(name).load()

    def class_names(self) -> dict[str, str]:
        """Class name -> canonical name of its first entry, without importing anything."""
        found: dict[str, str] = {}
        for entry in self._entries.values():
            found.setdefault(entry.class_name, entry.name)
        return found

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _key(name) in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

    # ---- building ----------------------------------------------------------------------------------

    def build(self, name: str, **kwargs: Any) -> Any:
        """An instance of the class behind ``name``: its registered defaults, then ``kwargs``."""
        entry = self.entry(name)
        try:
            return entry.load()(**{**entry.defaults, **kwargs})
        except TypeError as err:
            # NOTE: the constructor's TypeError names an internal class (ZeROSettings.__init__() for
            # strategy_from_name("zero3", ofload=...)); a caller's misspelt keyword gets the CLI's message.
            found = re.search(r"unexpected keyword argument '(\w+)'", str(err))
            if found is None or found.group(1) not in kwargs:
                raise
            key, valid = found.group(1), self.options(entry.name)
            listing = "; ".join(o.describe() for o in valid.values())
            raise ValueError(f"unknown option {key!r} for {self.kind} {entry.name!r}"
                             f"{did_you_mean(key, valid) or '.'} Valid: {listing or '(none)'}") from None

    def options(self, name: str) -> dict[str, Option]:
        """The options a command line may set for ``name`` (imports the class to read its constructor)."""
        entry = self.entry(name)
        found = cli_options(entry.load())
        if entry.options is not None:
            found = {k: found[k] for k in entry.options if k in found}
        return found

    def parse_options(self, name: str, pairs: Iterable[str]) -> dict[str, Any]:
        """``["offload=cpu", "overlap_comm=false"]`` -> ``{"offload": "cpu", "overlap_comm": False}``.

        Each value is parsed as the constructor's annotation allows (``none``, ``true``/``false``,
        numbers such as ``5e8``, ``{...}`` JSON for dicts, else text).

        Raises:
            ValueError: not ``key=value``, an unknown or repeated option, or a value of the wrong type;
                the message names the option, the closest valid one and all of them.
        """
        pairs = list(pairs)
        if not pairs:
            return {}
        canonical = self.canonical(name)
        valid = self.options(canonical)
        listing = "; ".join(o.describe() for o in valid.values())
        parsed: dict[str, Any] = {}
        for pair in pairs:
            key, sep, text = str(pair).partition("=")
            key = key.strip().replace("-", "_")
            if not sep or not key:
                raise ValueError(f"{self.kind} option {pair!r} for {canonical!r} must be key=value "
                                 f"(e.g. {next(iter(valid), 'name')}=...). Valid: {listing or '(none)'}")
            if key not in valid:
                hint = did_you_mean(key, valid) or "."
                raise ValueError(f"unknown option {key!r} for {self.kind} {canonical!r}{hint} Valid: "
                                 f"{listing or '(none)'}")
            if key in parsed:
                raise ValueError(f"option {key!r} for {self.kind} {canonical!r} is given twice; give it once")
            try:
                parsed[key] = valid[key].parse(text)
            except ValueError as e:
                raise ValueError(f"{self.kind} {canonical!r} option {e}") from None
        return parsed

    def build_from_cli(self, name: str, pairs: Iterable[str] = (), **kwargs: Any) -> Any:
        """:meth:`build` with ``key=value`` options from a command line (see :meth:`parse_options`)."""
        options = self.parse_options(name, pairs)
        return self.build(name, **{**kwargs, **options})

    def argparse_type(self, *extra: str) -> Callable[[str], str]:
        """An argparse ``type=``: alias -> canonical name; unknown -> a usage error naming the closest name.

        Args:
            *extra: values taken as they are (e.g. ``"auto"``).
        """
        def convert(text: str) -> str:
            if text in extra:
                return text
            try:
                return self.canonical(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        convert.__name__ = self.kind
        return convert

    def describe(self) -> str:
        """One line per entry: name, aliases and description, for ``--help`` texts."""
        lines = []
        for entry in self._entries.values():
            also = f" (also {', '.join(entry.aliases)})" if entry.aliases else ""
            lines.append(f"{entry.name}{also}: {entry.description}")
        return "\n".join(lines)


# ---- constructor options ---------------------------------------------------------------------------


def cli_options(cls: type) -> dict[str, Option]:
    """Keyword arguments of ``cls``'s constructor that have a type a command line can give.

    A constructor taking ``**kwargs`` that it hands to a public base class's constructor (ZeROInfinity
    to ZeRO3) offers that constructor's arguments too.
    """
    found: dict[str, Option] = {}
    for owner in _constructors(cls):
        hints = _hints(owner.__init__)
        for param in inspect.signature(owner.__init__).parameters.values():
            if param.name == "self" or param.name in found or param.kind in (param.VAR_POSITIONAL,
                                                                            param.VAR_KEYWORD):
                continue
            if param.kind is param.POSITIONAL_ONLY:
                continue
            kinds = _kinds(hints.get(param.name, param.annotation))
            if kinds and kinds != (type(None),):  # only None: nothing a command line could usefully give
                annotation = param.annotation if isinstance(param.annotation, str) else _show(param.annotation)
                found[param.name] = Option(param.name, kinds, param.default, annotation)
    return found


def _constructors(cls: type) -> list[type]:
    """``cls``, then each public base whose constructor receives the previous one's ``**kwargs``."""
    chain = [cls]
    owner = _defining(cls)
    while owner is not None and any(p.kind is p.VAR_KEYWORD
                                    for p in inspect.signature(owner.__init__).parameters.values()):
        base = next((b for b in owner.__mro__[1:] if "__init__" in vars(b)), None)
        base = _defining(base) if base is not None else None
        if base is None or base is object or base.__name__.startswith("_"):
            break
        chain.append(base)
        owner = base
    return chain


def _defining(cls: type) -> type | None:
    """The class in ``cls``'s MRO whose ``__init__`` ``cls`` runs."""
    return next((c for c in cls.__mro__ if "__init__" in vars(c)), None)


def _hints(function: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function)
    except Exception:  # an annotation that does not evaluate here: read the strings instead
        return {}


_BY_NAME = {"None": type(None), "bool": bool, "int": int, "float": float, "str": str, "dict": dict}


def _kinds(hint: Any) -> tuple[type, ...]:
    """The parseable kinds in a type hint, in the order values are tried."""
    if hint is inspect.Parameter.empty:
        return ()
    if isinstance(hint, str):  # unevaluated: "int | str", "dict[str, Any] | None"
        parts = {_BY_NAME.get(p.strip().split("[")[0]) for p in hint.split("|") if _json_able(p.strip())}
    else:
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        parts = {typing.get_origin(a) or a for a in args if _json_able(a)}
        if typing.Any in parts:
            parts |= {type(None), bool, int, float, dict, str}
    return tuple(k for k in _KINDS if k in parts)


def _json_able(hint: Any) -> bool:
    """False for a dict whose values JSON cannot give (``dict[str, ParallelStyle]``: a TP plan of objects)."""
    if isinstance(hint, str):
        inner = hint.partition("[")[2].rstrip("]")
        return not hint.startswith("dict[") or all(p.strip() in _JSON_NAMES for p in inner.split(","))
    if typing.get_origin(hint) is not dict:
        return True
    return all(a is typing.Any or a in (str, int, float, bool) for a in typing.get_args(hint))


_JSON_NAMES = ("str", "int", "float", "bool", "Any")


def _show(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return "Any"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
