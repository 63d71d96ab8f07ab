"""Package attributes that import their module on first use (PEP 562), so that importing a package is cheap.

`shardkit launch --help` imported torch through `shardkit.distributed`'s eager re-exports: 8 s on a busy 2-core
machine for a help text (issue 30). A package lists its public names and the submodule defining each; they load
when first read, and `from package import name` keeps working.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


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


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of module ``package`` serving each of ``exports`` (name -> module).

    The modules are named relative to ``package``'s package (``"consolidate"`` in ``shardkit.checkpoint`` or in
    ``shardkit.checkpoint.zero_to_fp32`` is ``shardkit.checkpoint.consolidate``). Any other name that is a
    submodule of a package is imported too, as the eager imports made ``shardkit.checkpoint.format`` work before.
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
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*module.__dict__, *exports})

    return __getattr__, __dir__
