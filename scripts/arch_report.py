"""Counts that say whether the architecture in docs/ARCHITECTURE.md holds, read from the source alone.

Usage: ``python scripts/arch_report.py [--verbose] [SDK_DIR]`` (default: the ``sdk/`` beside this script).

It parses every module of the package with :mod:`ast` (nothing is imported, so it runs in a fraction of a
second without torch) and prints these counts:

* import cycles between the top-level units of ``sdk/`` (its packages and its top-level modules), counting
  every import: module level, inside functions, and under ``TYPE_CHECKING``;
* private names (``_x``) or private modules (``_mod``) imported from another top-level unit (and, for
  information, private names imported from another module of the same unit);
* engine references outside ``sdk/strategies/``: DeepSpeed imports, FSDP2's private state
  (``_get_fsdp_state()``, ``_fsdp_param_groups``, torch's ``fsdp._*`` modules, ...) and DeepSpeed's
  parameter attributes (``ds_tensor``, ``ds_id``, ... read as attributes or named in ``getattr``/``hasattr``);
* strategy class checks outside ``sdk/strategies/``: the strategy registry's ``STRATEGIES.get_class(...)`` and
  ``STRATEGIES.class_names()``, and ``isinstance``/``issubclass``/``type(x) is``/``type(x).__name__ ==`` against a
  strategy class (any subclass of ``Strategy`` defined there; ``Strategy`` itself, the contract's type, is fine).
  Code elsewhere asks the strategy's declared facts (``family``, ``dims``, ``model_state_memory``, ...).

``tests/unit/test_architecture.py`` enforces the same rules with these functions.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Import",
    "Reference",
        "engine_references",
    "import_cycles",
    "strategy_class_checks",
    "package_graph",
    "parse_imports",
    "private_imports",
    "unit_of",
]

PACKAGE = "shardkit"
ENGINE_HOME = "strategies"  # the only top-level unit that may name an engine's internals
# FSDP2 keeps its state on private attributes; reading them ties the code to one torch release.
FSDP2_PRIVATE = re.compile(r"^_(get_)?fsdp|^_auto_reshard_after_forward$|^_reshard_after_forward$")
FSDP2_PRIVATE_MODULE = re.compile(r"^torch\.distributed\.fsdp\._")
# The attributes DeepSpeed's ZeRO-3 puts on each partitioned parameter.
DEEPSPEED_PARAM_ATTRS = frozenset({
    "ds_id", "ds_numel", "ds_persist", "ds_process_group", "ds_shape", "ds_status", "ds_tensor",
})


@dataclass(frozen=True)
class Import:
    """One import statement's target, seen from the module that makes it."""

    source: str  # dotted module name, "shardkit.inference.sync"
    target: str  # dotted module imported from, "shardkit.strategies._dtensor"
    names: tuple[str, ...]  # the names taken (empty for ``import x.y``)
    line: int


@dataclass(frozen=True)
class Reference:
    """A place in the source that breaks a rule."""

    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def iter_modules(root: Path) -> Iterator[tuple[str, Path]]:
    """``(dotted name, path)`` of every ``.py`` file under ``root`` (the directory that is ``shardkit``)."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [PACKAGE, *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _resolve(source: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".") if is_package else source.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def parse_imports(root: Path) -> tuple[list[Import], dict[str, ast.Module]]:
    """Every import in the package (module level, in functions, under TYPE_CHECKING) and each module's tree."""
    imports: list[Import] = []
    trees: dict[str, ast.Module] = {}
    for name, path in iter_modules(root):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        trees[name] = tree
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports.extend(Import(name, a.name, (), node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, path.name == "__init__.py", node)
                imports.append(Import(name, target, tuple(a.name for a in node.names), node.lineno))
    return imports, trees


def unit_of(module: str, units: set[str]) -> str | None:
    """The top-level unit (``strategies``, ``runner``) a dotted ``shardkit...`` name belongs to, else None."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1] if parts[1] in units else None


def top_level_units(root: Path) -> set[str]:
    """The packages and modules directly under ``root``, except ``__init__``."""
    units = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    return units


def _targets(imp: Import, units: set[str]) -> Iterator[str]:
    """The units an import depends on. ``from shardkit import x`` names unit ``x`` when ``x`` is one."""
    unit = unit_of(imp.target, units)
    if unit is not None:
        yield unit
    elif imp.target == PACKAGE:
        yield from (n for n in imp.names if n in units)


def package_graph(root: Path) -> dict[str, dict[str, list[Import]]]:
    """``{unit: {unit it imports: [the imports]}}`` between distinct top-level units."""
    units = top_level_units(root)
    imports, _ = parse_imports(root)
    graph: dict[str, dict[str, list[Import]]] = {u: {} for u in sorted(units)}
    for imp in imports:
        src = unit_of(imp.source, units)
        if src is None:  # shardkit/__init__.py: the facade that re-exports every unit
            continue
        for dst in _targets(imp, units):
            if dst != src:
                graph[src].setdefault(dst, []).append(imp)
    return graph


def import_cycles(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Every elementary cycle of the unit graph, each listed once, starting at its smallest name."""
    cycles: list[list[str]] = []

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                cycles.append(list(path))
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return cycles


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root: Path, across: str = "package") -> list[Reference]:
    """Imports of shardkit's ``_private`` names and modules made from outside their owner.

    Args:
        across: "package": a private name or module of one top-level unit imported from another (the rule
            the tests enforce); "module": a private name (not a module) imported from another module, in any
            unit. A unit's private helper modules (``strategies/_mesh.py``) used by its own modules are fine.
    """
    units = top_level_units(root)
    imports, _ = parse_imports(root)
    modules = {name for name, _ in iter_modules(root)}
    found = []
    for imp in imports:
        src, dst = unit_of(imp.source, units), unit_of(imp.target, units)
        if dst is None or (across == "package" and src == dst):
            continue
        taken = [n for n in imp.names if _is_private(n)]
        if across == "package" and any(_is_private(p) for p in imp.target.split(".")[2:]):
            found.append(Reference(imp.source, imp.line, f"imports from the private module {imp.target}"))
        elif across == "package" and taken:
            found.append(Reference(imp.source, imp.line, f"imports {', '.join(taken)} from {imp.target}"))
        elif across == "module" and [n for n in taken if f"{imp.target}.{n}" not in modules]:
            names = [n for n in taken if f"{imp.target}.{n}" not in modules]
            found.append(Reference(imp.source, imp.line, f"imports {', '.join(names)} from {imp.target}"))
    return found


def _attribute_names(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Attributes read or written, and the names given to getattr/hasattr/setattr as literals."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in {"getattr", "hasattr", "setattr", "delattr"} and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node.lineno, node.args[1].value


def engine_references(root: Path) -> list[Reference]:
    """DeepSpeed imports, FSDP2 private state and DeepSpeed parameter attributes outside ``strategies/``."""
    units = top_level_units(root)
    imports, trees = parse_imports(root)
    found = []
    for imp in imports:
        if unit_of(imp.source, units) == ENGINE_HOME:
            continue
        if imp.target.split(".")[0] == "deepspeed":
            found.append(Reference(imp.source, imp.line, f"imports {imp.target}"))
        elif FSDP2_PRIVATE_MODULE.match(imp.target):
            found.append(Reference(imp.source, imp.line, f"imports FSDP2's private {imp.target}"))
    for module, tree in trees.items():
        if unit_of(module, units) == ENGINE_HOME:
            continue
        for line, attr in _attribute_names(tree):
            if FSDP2_PRIVATE.match(attr):
                found.append(Reference(module, line, f"touches FSDP2's private {attr}"))
            elif attr in DEEPSPEED_PARAM_ATTRS:
                found.append(Reference(module, line, f"reads DeepSpeed's parameter attribute {attr}"))
    return sorted(found, key=lambda r: (r.module, r.line))


def strategy_classes(trees: dict[str, ast.Module], units: set[str]) -> set[str]:
    """Names of the classes defined in ``strategies/`` that derive from ``Strategy`` (by their bases' names), less
    ``Strategy`` itself."""
    bases: dict[str, set[str]] = {}
    for module, tree in trees.items():
        if unit_of(module, units) != ENGINE_HOME:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                named = (b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute)))
                bases.setdefault(node.name, set()).update(named)
    found = {"Strategy"}
    grown = True
    while grown:
        new = {name for name, parents in bases.items() if parents & found} - found
        found |= new
        grown = bool(new)
    return found - {"Strategy"}


def _named(node: ast.AST) -> list[str]:
    """The class names an isinstance target, ``type(x) is`` operand or string names (tuples flattened)."""
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _named(elt)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    return []


def _is_type_of(node: ast.AST) -> bool:
    """``type(x)`` or ``x.__class__``; with ``.__name__`` after it as well."""
    if isinstance(node, ast.Attribute) and node.attr == "__name__":
        node = node.value
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type") or (
        isinstance(node, ast.Attribute) and node.attr == "__class__")


def strategy_class_checks(root: Path) -> list[Reference]:
    """Places outside ``strategies/`` that ask which strategy an object is by its class (see the module docstring)."""
    units = top_level_units(root)
    _, trees = parse_imports(root)
    classes = strategy_classes(trees, units)
    found = []
    for module, tree in trees.items():
        if unit_of(module, units) == ENGINE_HOME:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("get_class", "class_names")
                    and _named(node.func.value)[-1:] == ["STRATEGIES"]):
                found.append(Reference(module, node.lineno, f"asks the strategy registry {node.func.attr}()"))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                named = sorted(set(_named(node.args[1])) & classes)
                if named or any(isinstance(n, ast.Call) and _named(n.func)[-1:] == ["get_class"]
                                for n in ast.walk(node.args[1])):
                    what = ", ".join(named) or "a registry class"
                    found.append(Reference(module, node.lineno, f"{node.func.id}() against {what}"))
            elif isinstance(node, ast.Compare) and len(node.comparators) == 1:
                left, right = node.left, node.comparators[0]
                for a, b in ((left, right), (right, left)):
                    named = sorted(set(_named(b)) & classes)
                    if _is_type_of(a) and named:
                        found.append(Reference(module, node.lineno, f"compares a class with {', '.join(named)}"))
                        break
    return sorted(found, key=lambda r: (r.module, r.line))


def main(argv: list[str] | None = None) -> int:
    """Print the counts (and, with --verbose, each place)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1] / "sdk")
    parser.add_argument("--verbose", "-v", action="store_true", help="list every cycle and reference")
    args = parser.parse_args(argv)
    graph = package_graph(args.root)
    cycles = import_cycles(graph)
    private = private_imports(args.root)
    private_names = private_imports(args.root, across="module")
    engine = engine_references(args.root)
    class_checks = strategy_class_checks(args.root)
    print(f"import cycles between top-level units of {args.root.name}/: {len(cycles)}")
    if args.verbose:
        for cycle in cycles:
            hops = [f"{a} -> {b} ({graph[a][b][0].source}:{graph[a][b][0].line})"
                    for a, b in zip(cycle, cycle[1:] + cycle[:1])]
            print("  " + "; ".join(hops))
    print(f"cross-package private imports: {len(private)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in private), end="")
    print(f"private names imported from another module: {len(private_names)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in private_names), end="")
    print(f"engine references outside {ENGINE_HOME}/: {len(engine)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in engine), end="")
    print(f"strategy class checks outside {ENGINE_HOME}/: {len(class_checks)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in class_checks), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
