"""Counts that say whether the architecture in docs/ARCHITECTURE.md holds, read from the source alone.

Usage: ``python scripts/arch_report.py [--verbose] [SDK_DIR]`` (default: the ``sdk/`` beside this script).

It parses every module of the package with :mod:`ast` (nothing is imported, so it runs in a fraction of a
second without torch) and prints these counts:

* import cycles between the top-level units of ``sdk/`` (its packages and its top-level modules), counting
  every import: module level, inside functions, and under ``TYPE_CHECKING``;
* import cycles between modules (each group of modules that import one another counted once), counting the same
  imports, except one inside a function whose line says why it waits for the call:
  ``# deferred: start-up time (torch)`` (the form ``DEFERRED_MARK`` reads; the report lists them all);
* private names (``_x``) or private modules (``_mod``) imported from another top-level unit, and private names
  imported from another module of any unit;
* modules writing their own ``__getattr__`` instead of taking it from ``utils.lazy.lazy_exports``;
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
import functools
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Import",
    "Reference",
    "engine_references",
    "import_cycles",
    "closed_path",
    "module_cycles",
    "module_graph",
    "own_module_getattrs",
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
# The one form of comment that exempts an import inside a function from the module cycle count: the import is
# deferred so that importing its module stays cheap (``# deferred: start-up time (torch)``), not to hide a cycle.
DEFERRED_MARK = re.compile(r"#\s*deferred: start-up time \(([^()]+)\)")
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
    in_function: bool = False  # made when a function runs, not when its module loads
    # what the import is deferred to keep out of start-up (``torch``), from its ``DEFERRED_MARK`` comment; only an
    # import inside a function can be deferred
    deferred_for: str | None = None


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


def _imports_in(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of ``tree`` and whether it sits inside a function (runs only when called)."""
    def walk(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            else:
                yield from walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                           ast.Lambda)))
    yield from walk(tree, False)


def _deferred_for(lines: list[str], node: ast.stmt, in_function: bool) -> str | None:
    """The reason in a ``DEFERRED_MARK`` comment on the import's lines, if the import is inside a function."""
    if not in_function:
        return None
    for text in lines[node.lineno - 1: node.end_lineno or node.lineno]:
        found = DEFERRED_MARK.search(text)
        if found:
            return found.group(1).strip()
    return None


@functools.lru_cache(maxsize=4)
def parse_imports(root: Path) -> tuple[list[Import], dict[str, ast.Module]]:
    """Every import in the package (module level, in functions, under TYPE_CHECKING) and each module's tree.

    Parsed once per ``root`` in a process (every count reads it; callers must not change what it returns).
    """
    imports: list[Import] = []
    trees: dict[str, ast.Module] = {}
    for name, path in iter_modules(root):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        trees[name] = tree
        for node, in_function in _imports_in(tree):
            deferred_for = _deferred_for(lines, node, in_function)
            if isinstance(node, ast.Import):
                imports.extend(Import(name, a.name, (), node.lineno, in_function, deferred_for) for a in node.names)
            else:
                target = _resolve(name, path.name == "__init__.py", node)
                imports.append(Import(name, target, tuple(a.name for a in node.names), node.lineno, in_function,
                                      deferred_for))
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


def _lazy_tables(trees: dict[str, ast.Module]) -> dict[str, dict[str, str]]:
    """``{package: {name: dotted module defining it}}`` from each ``lazy_exports(__name__, {...})`` call."""
    tables: dict[str, dict[str, str]] = {}
    for module, tree in trees.items():
        assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_exports"
                    and len(node.args) >= 2):
                continue
            table = node.args[1]
            table = assigned.get(table.id, table) if isinstance(table, ast.Name) else table
            if isinstance(table, ast.Dict):
                # the modules are named relative to the package holding ``module`` (utils.lazy.lazy_exports)
                parent = module if _is_package(module, trees) else module.rpartition(".")[0]
                tables[module] = {k.value: f"{parent}.{v.value}" for k, v in zip(table.keys, table.values)
                                  if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return tables


def _is_package(module: str, modules: Mapping[str, object]) -> bool:
    return any(other.startswith(module + ".") for other in modules)


def _module_targets(imp: Import, modules: set[str], lazy: dict[str, dict[str, str]]) -> Iterator[str]:
    """The shardkit modules an import runs: the most specific module it names, and for ``from package import
    name`` the module that defines ``name`` when the package serves it lazily (utils/lazy.py)."""
    target = imp.target
    while target and target not in modules:
        target = target.rpartition(".")[0]
    if not target:
        return
    if not imp.names:
        yield target
    for name in imp.names:
        if f"{target}.{name}" in modules:
            yield f"{target}.{name}"
            continue
        yield target
        where, seen = target, set()
        while name in lazy.get(where, {}) and where not in seen:  # shardkit.Runner -> runner -> runner.core
            seen.add(where)
            where = lazy[where][name]
            if where in modules:
                yield where


def module_graph(root: Path) -> dict[str, dict[str, list[Import]]]:
    """``{module: {module it imports: [the imports]}}`` between shardkit's modules.

    Every import counts, at module level, inside functions and under TYPE_CHECKING, except an import inside a
    function marked as deferred for start-up time (``DEFERRED_MARK``). The package a module sits in, which Python
    runs first, is not an edge of its own; a lazily exported name is an edge to the module defining it.
    """
    imports, trees = parse_imports(root)
    modules = set(trees)
    lazy = _lazy_tables(trees)
    graph: dict[str, dict[str, list[Import]]] = {m: {} for m in sorted(modules)}
    for imp in imports:
        if imp.deferred_for is not None:
            continue
        for dst in _module_targets(imp, modules, lazy):
            if dst != imp.source:
                graph[imp.source].setdefault(dst, []).append(imp)
    return graph


def module_cycles(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """The import cycles between modules, one per group of modules that reach each other (a strongly connected
    component of more than one module), each the group's sorted module names (:func:`closed_path` gives one cycle
    through it).

    A group is counted once however many elementary cycles run through it: breaking it is one change of layering.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    counter = 0
    for start in sorted(graph):  # Tarjan's algorithm, iterative: a long import chain must not hit the recursion limit
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return sorted(sorted(group) for group in groups)


def closed_path(graph: dict[str, dict[str, list[Import]]], group: list[str]) -> list[str]:
    """A shortest path from the group's smallest module back to itself, inside the group (breadth first)."""
    members = set(group)
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                if nxt in members and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


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


def own_module_getattrs(root: Path) -> list[Reference]:
    """Modules that write their own ``__getattr__`` (PEP 562) instead of taking it from ``utils.lazy.lazy_exports``,
    the one mechanism for names loaded on first use (its ``fallback`` serves names a registry knows)."""
    _, trees = parse_imports(root)
    return [Reference(module, node.lineno, "defines its own module __getattr__ (use utils.lazy.lazy_exports)")
            for module, tree in trees.items() for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__getattr__"]


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
    modules = module_graph(args.root)
    cycles = module_cycles(modules)
    print(f"import cycles between modules of {args.root.name}/: {len(cycles)}")
    if args.verbose:
        for group in cycles:
            path = closed_path(modules, group)
            hops = [f"{a.removeprefix(PACKAGE + '.')} -> {b.removeprefix(PACKAGE + '.')} ({modules[a][b][0].line})"
                    for a, b in zip(path, path[1:] + path[:1])]
            print(f"  {', '.join(m.removeprefix(PACKAGE + '.') for m in group)}: " + "; ".join(hops))
    deferred = [imp for imp in parse_imports(args.root)[0] if imp.deferred_for is not None]
    print(f"imports deferred for start-up time (not in the module count): {len(deferred)}")
    if args.verbose:
        print("".join(f"  {i.source}:{i.line}: {i.target} ({i.deferred_for})\n" for i in deferred), end="")
    print(f"cross-package private imports: {len(private)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in private), end="")
    print(f"private names imported from another module: {len(private_names)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in private_names), end="")
    getattrs = own_module_getattrs(args.root)
    print(f"module __getattr__ written beside utils.lazy.lazy_exports: {len(getattrs)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in getattrs), end="")
    print(f"engine references outside {ENGINE_HOME}/: {len(engine)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in engine), end="")
    print(f"strategy class checks outside {ENGINE_HOME}/: {len(class_checks)}")
    if args.verbose:
        print("".join(f"  {r}\n" for r in class_checks), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
