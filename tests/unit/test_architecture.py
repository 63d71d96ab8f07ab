"""The architecture rules of docs/ARCHITECTURE.md, checked on the source with ast (nothing is imported; ~2 s):

- no import cycle between the top-level units of sdk/ (its packages and top-level modules), counting imports
  inside functions and under TYPE_CHECKING too;
- no import cycle between modules either, counting the same imports, except an import inside a function marked
  ``# deferred: start-up time (<what it keeps out>)``;
- engine internals stay inside sdk/strategies/: no DeepSpeed import, no FSDP2 private state, no DeepSpeed
  parameter attribute (``ds_tensor``, ...) anywhere else;
- no private name or private module of one unit imported from another, and no private name imported from
  another module at all;
- one lazy-export mechanism: no module writes its own ``__getattr__`` beside ``utils.lazy.lazy_exports``;
- no strategy class checks outside sdk/strategies/: no ``STRATEGIES.get_class``/``class_names`` and no
  ``isinstance``/``type(x) is`` against a strategy class; fronts and tools ask the strategy's declared facts.

Each rule is also shown to fail: a violation planted in a copy of sdk/ is found and named.
The counts and every place: ``python scripts/arch_report.py -v``.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "sdk"


def _load_report():
    spec = importlib.util.spec_from_file_location("arch_report", ROOT / "scripts" / "arch_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["arch_report"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


arch = _load_report()

# One copy of sdk/ with a violation of every rule planted in it, checked once (each parse of sdk/ takes ~0.5 s).
PLANTED = {
    # a lazy import inside a function is a dependency all the same: runner -> strategies -> runner
    "strategies/base.py": "def _late():\n    from shardkit.runner.core import Runner  # noqa",
    "nn/loss.py": "from shardkit.trainer import Trainer",  # trainer -> nn -> trainer
    "inference/generate.py": "import deepspeed.comm",
    "inference/sync.py": "def _f(m):\n    return m._get_fsdp_state()._fsdp_param_groups",
    "inference/batch.py": "from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState",
    "nn/rotary.py": "def _g(p):\n    return hasattr(p, 'ds_tensor')",
    "models/text.py": "from shardkit.strategies._dtensor import local_tensor\n"
                      "from shardkit.config.deepspeed import _activation_checkpointing",
    "models/llama.py": "from shardkit.models.text import _planted_private",  # inside one package, still private
    "optim/named.py": "def __getattr__(name):\n    raise AttributeError(name)",  # a second lazy mechanism
    # which strategy is this, by its class: four ways
    "data/loader.py": "def _which(s):\n    from shardkit.strategies.registry import STRATEGIES\n"
                      "    from shardkit.strategies.fsdp import FSDP\n"
                      "    return (isinstance(s, (FSDP, int)) or isinstance(s, STRATEGIES.get_class('zero3'))\n"
                      "            or type(s).__name__ == 'ContextParallel' or STRATEGIES.class_names())",
}
# Cycles between modules inside one package, planted in a copy of their own: the package cycles above join most
# modules into one cycle, which would hide these.
PLANTED_MODULE_CYCLES = {
    # process_group -> timeouts -> process_group, through a deferred import ...
    "distributed/timeouts.py": "def _late():\n    from shardkit.distributed.process_group import init_distributed",
    # ... and launcher -> signals -> launcher, through a name the package serves lazily (utils/lazy.py)
    "distributed/signals.py": "def _late():\n    from shardkit.distributed import launch",
    # a deferral marked for start-up time inside a function is not a dependency of the module (reader -> format)
    "checkpoint/format.py": "def _cheap():\n    from shardkit.checkpoint.reader import CheckpointReader"
                            "  # deferred: start-up time (torch)",
    # the same mark on a module-level import defers nothing: hf -> export -> hf
    "checkpoint/export.py": "from shardkit.checkpoint.hf import load_pretrained  # deferred: start-up time (torch)",
}


def _planted_copy(tmp_path_factory, plants: dict[str, str]) -> Path:
    """A copy of sdk/ (sources only) with each of ``plants`` appended to its file."""
    copy = tmp_path_factory.mktemp("planted") / "sdk"
    shutil.copytree(SDK, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.md", "py.typed"))
    for relative, code in plants.items():
        target = copy / relative
        target.write_text(target.read_text() + "\n" + code + "\n")
    return copy


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """A copy of sdk/ with PLANTED appended, and every engine snippet again inside strategies/."""
    copy = _planted_copy(tmp_path_factory, PLANTED)
    engine = [code for rel, code in PLANTED.items() if rel.startswith(("inference/", "nn/rotary", "data/loader"))]
    (copy / "strategies" / "planted.py").write_text("\n".join(engine) + "\n")  # allowed there
    return copy


def test_no_import_cycle_between_top_level_packages():
    cycles = arch.import_cycles(arch.package_graph(SDK))
    assert not cycles, "import cycles between sdk's top-level units (scripts/arch_report.py -v shows where): " + \
        "; ".join(" -> ".join(c + c[:1]) for c in cycles)


def test_no_import_cycle_between_modules():
    graph = arch.module_graph(SDK)
    cycles = arch.module_cycles(graph)
    assert not cycles, "import cycles between modules of sdk/ (move what both sides need into the lower module; " \
        "an import deferred only to keep start-up cheap says so: `# deferred: start-up time (torch)`):\n" + \
        "\n".join(f"{', '.join(group)}, e.g. " + " -> ".join(path + path[:1])
                  for group in cycles for path in [arch.closed_path(graph, group)])


def test_engine_internals_stay_inside_strategies():
    found = arch.engine_references(SDK)
    assert not found, "engine internals outside sdk/strategies/ (add a Strategy hook or go through " \
                      "utils/partitioned.py):\n" + "\n".join(map(str, found))


def test_no_private_import_across_packages():
    found = arch.private_imports(SDK)
    assert not found, "private names imported across packages (make them public where others need them):\n" + \
        "\n".join(map(str, found))


def test_no_private_name_imported_from_another_module():
    found = arch.private_imports(SDK, across="module")
    assert not found, "private names imported from another module (make them public, or keep the code that " \
        "needs them in their module):\n" + "\n".join(map(str, found))


def test_planted_cycles_are_found(planted):
    cycles = [sorted(c) for c in arch.import_cycles(arch.package_graph(planted))]
    assert ["runner", "strategies"] in cycles and ["nn", "trainer"] in cycles, cycles


def test_one_lazy_export_mechanism():
    found = arch.own_module_getattrs(SDK)
    assert not found, "\n".join(map(str, found))


def test_planted_module_getattr_is_found(planted):
    assert [(r.module, r.line > 1) for r in arch.own_module_getattrs(planted)] == [("shardkit.optim.named", True)]


def test_planted_module_cycles_are_found_and_marked_deferrals_are_not(tmp_path_factory):
    planted = _planted_copy(tmp_path_factory, PLANTED_MODULE_CYCLES)
    groups = [[m.removeprefix("shardkit.") for m in c] for c in arch.module_cycles(arch.module_graph(planted))]
    def together(a: str, b: str) -> bool:
        return any(a in group and b in group for group in groups)

    assert together("distributed.process_group", "distributed.timeouts"), groups
    assert together("distributed.launcher", "distributed.signals"), groups
    assert together("checkpoint.export", "checkpoint.hf"), groups
    assert not together("checkpoint.format", "checkpoint.reader"), groups
    deferred = {(i.source, i.target, i.deferred_for) for i in arch.parse_imports(planted)[0] if i.deferred_for}
    assert ("shardkit.checkpoint.format", "shardkit.checkpoint.reader", "torch") in deferred, deferred
    assert not any(source == "shardkit.checkpoint.export" for source, _, _ in deferred), deferred


def test_planted_engine_references_are_found_outside_strategies_only(planted):
    found = {(r.module.removeprefix("shardkit."), r.what) for r in arch.engine_references(planted)}
    assert found == {("inference.generate", "imports deepspeed.comm"),
                     ("inference.sync", "touches FSDP2's private _get_fsdp_state"),
                     ("inference.sync", "touches FSDP2's private _fsdp_param_groups"),
                     ("inference.batch", "imports FSDP2's private torch.distributed.fsdp._fully_shard._fsdp_state"),
                     ("nn.rotary", "reads DeepSpeed's parameter attribute ds_tensor")}, found


def test_planted_private_imports_across_packages_are_found(planted):
    found = {r.what for r in arch.private_imports(planted)}
    assert found == {"imports from the private module shardkit.strategies._dtensor",
                     "imports _activation_checkpointing from shardkit.config.deepspeed"}, found
    within = {(r.module, r.what) for r in arch.private_imports(planted, across="module")}
    assert {("shardkit.models.llama", "imports _planted_private from shardkit.models.text"),
            ("shardkit.models.text", "imports _activation_checkpointing from shardkit.config.deepspeed")} <= within
    assert not any("_dtensor" in what for _, what in within), within  # a private module is no private name


def test_no_strategy_class_checks_outside_strategies():
    found = arch.strategy_class_checks(SDK)
    assert not found, "strategy class checks outside sdk/strategies/ (ask the strategy's declared facts: family, " \
                      "dims, model_state_memory, ...; see strategies/README.md):\n" + "\n".join(map(str, found))


def test_planted_strategy_class_checks_are_found_outside_strategies_only(planted):
    found = {(r.module.removeprefix("shardkit."), r.what) for r in arch.strategy_class_checks(planted)}
    assert found == {("data.loader", "isinstance() against FSDP"),
                     ("data.loader", "isinstance() against a registry class"),
                     ("data.loader", "asks the strategy registry get_class()"),
                     ("data.loader", "compares a class with ContextParallel"),
                     ("data.loader", "asks the strategy registry class_names()")}, found


def test_the_package_root_holds_only_its_init_and_packages():
    """Every module lives in the package of its concept; the root is `__init__.py` (and the typing marker)."""
    loose = sorted(p.name for p in SDK.iterdir()
                   if p.is_file() and p.name not in ("__init__.py", "py.typed"))
    assert not loose, f"modules at the root of sdk/: {loose}; put each in the package it belongs to " \
                      "(docs/ARCHITECTURE.md, 'Where things live')"
    packages = [p for p in SDK.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert all((p / "__init__.py").is_file() for p in packages), [p.name for p in packages]


def test_moved_module_paths_import_the_module_at_its_new_path():
    """A path that documentation or a user's script names keeps working after a move: one module object."""
    import importlib

    lazy = importlib.import_module("shardkit.utils.lazy")
    for old, new in lazy.MOVED_MODULES.items():
        assert not (SDK / (old.removeprefix("shardkit.").replace(".", "/") + ".py")).exists(), old
        assert importlib.import_module(old) is importlib.import_module(new), old
