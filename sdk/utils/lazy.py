"""Package attributes that import their module on first use (PEP 562), so that importing a package is cheap.

`shardkit launch --help` imported torch through `shardkit.distributed`'s eager re-exports: 8 s on a busy 2-core
machine for a help text (benchmarks/RESULTS.md, "`shardkit --help` without torch"). A package lists its public
names and the submodule defining each; they load when first read, and `from package import name` keeps working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable, Mapping

__all__ = ["MOVED_MODULES", "install_moved_modules", "lazy_exports"]

# Public modules that moved (sdk/'s root emptied into packages, names that said too little or that another package
# used for its own module of the same concept; old path -> new): the old paths, which documentation and users'
# scripts name, import the new module itself (one object, so a monkeypatch of either name reaches the code that runs).
MOVED_MODULES: Mapping[str, str] = {
    "shardkit.runner_checkpoints": "shardkit.runner.checkpoints",
    "shardkit.runner_observe": "shardkit.runner.observe",
    "shardkit.user_state": "shardkit.runner.user_state",
    "shardkit.seeding": "shardkit.utils.seeding",
    "shardkit.streaming": "shardkit.data.streaming",
    "shardkit.cli_args": "shardkit.utils.parsing",
    "shardkit.build_ops_cli": "shardkit.cli.build_ops",
    "shardkit.env_info": "shardkit.cli.env_info",
    "shardkit.dtypes": "shardkit.utils.dtypes",
    "shardkit.registry": "shardkit.utils.registry",
    "shardkit.suggest": "shardkit.utils.suggest",
    "shardkit.tracking": "shardkit.observability.trackers",
    "shardkit.hub": "shardkit.trainer.hub_pusher",
    "shardkit.strategies.mesh": "shardkit.strategies.parallel_dims",
    "shardkit.accelerate_compat.trackers": "shardkit.accelerate_compat.tracking",
    "shardkit.config.fsdp": "shardkit.config.fsdp_options",
    "shardkit.checkpoint.deepspeed_schema": "shardkit.checkpoint.deepspeed_file_schema",
}


class _LazyPackage(types.ModuleType):
    """A package whose exported name equal to one of its submodules stays the export once that submodule loads."""

    _shardkit_exports: Mapping[str, str]

    def __setattr__(self, name: str, value: object) -> None:
        # NOTE: the import system binds `package.consolidate` to the submodule when `package.consolidate` first
        # loads; the eager `from .consolidate import consolidate` rebound it to the function, and so does this.
        exports = self.__dict__.get("_shardkit_exports", {})
        if isinstance(value, types.ModuleType) and exports.get(name) == name and \
                value.__name__ == f"{self.__name__}.{name}" and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: Mapping[str, str], fallback: Callable[[str], object] | None = None,
                 fallback_names: Callable[[], Iterable[str]] = tuple,
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of module ``package`` serving each of ``exports`` (name -> module).

    The modules are named relative to ``package``'s package (``"consolidate"`` in ``shardkit.checkpoint`` or in
    ``shardkit.checkpoint.zero_to_fp32`` is ``shardkit.checkpoint.consolidate``). Any other name that is a
    submodule of a package is imported too, as the eager imports made ``shardkit.checkpoint.format`` work before.

    Args:
        fallback: asked for any other name, last: returns its value or raises AttributeError (names a registry
            serves, such as the strategies registered under ``shardkit.strategies``, loaded on first use too).
        fallback_names: the names ``fallback`` serves, for ``dir()``.
    """
    module = sys.modules[package]
    parent = module.__package__
    module.__dict__["_shardkit_exports"] = dict(exports)
    module.__class__ = _LazyPackage

    def __getattr__(name: str) -> object:
        if name in exports:
            value = getattr(importlib.import_module(f"{parent}.{exports[name]}"), name)
            module.__dict__[name] = value
            return value
        is_package = "__path__" in module.__dict__
        if is_package and not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        if fallback is not None and not name.startswith("__"):
            return fallback(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*module.__dict__, *exports, *fallback_names()})

    return __getattr__, __dir__


class _MovedModuleLoader(importlib.abc.Loader):
    """Serves an old module path with the module at its new path (see ``MOVED_MODULES``)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the target module ran when it was imported."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        moved_to = MOVED_MODULES.get(fullname)
        if moved_to is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(moved_to))


def install_moved_modules() -> None:
    """Make every old path in ``MOVED_MODULES`` importable (once per process; ``shardkit/__init__`` calls it)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())  # before the path finders: an old file left behind loses
