"""Run Accelerate's own test scripts against shardkit's Accelerator, with the import swapped at run time.

    python scripts/run_accelerate_scripts.py                          # the four scripts on 1 and 2 processes
    python scripts/run_accelerate_scripts.py --scripts test_sync --num-processes 2 --json out.json

The scripts ship inside the installed ``accelerate`` package (``accelerate/test_utils/scripts/``); nothing of
them is copied here. Each process imports ``accelerate``, replaces the public names shardkit implements
(``Accelerator``, ``PartialState``, ``AcceleratorState``, the configuration classes, ``set_seed`` and the
collectives of ``accelerate.utils``) by shardkit's, then loads the script as a module and runs its ``main()``.
Every function ``main()`` calls directly is a check: a check that raises is recorded (with the last line of its
error) and ``main()`` goes on, so one run reports every check. Names the front does not offer
(``accelerate.utils.operations.copy_tensor_to_devices``) are replaced by a function that raises, so a check can
pass only through shardkit. Accelerate's test helpers (``RegressionModel``, ``are_the_same_tensors`` ...) stay
Accelerate's. A check passes when it passes on every process.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

DEFAULT_SCRIPTS = ("test_sync", "test_distributed_data_loop", "test_ops", "test_script")
# Scripts written for a number of processes (they assert it first): run on that number only.
ONLY_ON = {"test_distributed_data_loop": 2}

# accelerate module -> names replaced by shardkit.accelerate_compat's of the same name.
SWAPS = {
    "accelerate": ("Accelerator", "PartialState", "notebook_launcher"),
    "accelerate.accelerator": ("Accelerator", "DataLoaderConfiguration", "GradientAccumulationPlugin",
                               "ProjectConfiguration"),
    "accelerate.state": ("PartialState", "AcceleratorState"),
    "accelerate.utils": ("DataLoaderConfiguration", "GradientAccumulationPlugin", "ProjectConfiguration",
                         "DistributedDataParallelKwargs", "InitProcessGroupKwargs", "GradScalerKwargs",
                         "AutocastKwargs", "set_seed", "gather", "gather_object", "broadcast", "reduce",
                         "pad_across_processes", "send_to_device", "synchronize_rng_states"),
    "accelerate.utils.dataclasses": ("DataLoaderConfiguration", "GradientAccumulationPlugin", "ProjectConfiguration",
                                     "DistributedDataParallelKwargs", "InitProcessGroupKwargs"),
    "accelerate.utils.operations": ("DistributedOperationException", "gather", "gather_object", "broadcast", "reduce",
                                    "pad_across_processes", "send_to_device"),
    "accelerate.utils.random": ("set_seed", "synchronize_rng_states"),
    "accelerate.data_loader": ("prepare_data_loader", "SeedableRandomSampler", "BatchSamplerShard"),
}
# Public names the scripts call that shardkit's front does not offer: they raise instead of running Accelerate's.
NOT_OFFERED = {"accelerate.utils.operations": ("copy_tensor_to_devices",)}


def scripts_dir() -> Path:
    """Where the installed accelerate keeps its test scripts."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or spec.origin is None:
        raise SystemExit("accelerate is not installed: pip install accelerate (requirements-test.txt pins it)")
    return Path(spec.origin).parent / "test_utils" / "scripts"


def swap_imports() -> None:
    """Point accelerate's public names at shardkit's front (in this process only)."""
    import importlib

    import shardkit.accelerate_compat as front

    for module_name, names in SWAPS.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, getattr(front, name))
    for module_name, names in NOT_OFFERED.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, _not_offered(f"{module_name}.{name}"))


def _not_offered(qualified: str):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{qualified} is not part of shardkit's front (Accelerator.prepare is)")

    return refuse


def _checks_of(source: str) -> set[str]:
    """Module-level functions that ``main()`` calls directly and that are named as tests or checks (helpers such as
    ``create_accelerator`` are not)."""
    tree = ast.parse(source)
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return set()
    return {node.func.id for node in ast.walk(main)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defined
            and (node.func.id.startswith("test") or "check" in node.func.id)}


def _describe(args: tuple, kwargs: dict) -> str:
    shown = [a for a in args if isinstance(a, (bool, int, str))] + [f"{k}={v}" for k, v in kwargs.items()
                                                                    if isinstance(v, (bool, int, str))]
    return f"({', '.join(map(str, shown))})" if shown else ""


def _recorded(function, records: list[dict[str, Any]]):
    @functools.wraps(function)
    def check(*args: Any, **kwargs: Any) -> Any:
        name = function.__name__ + _describe(args, kwargs)
        try:
            result = function(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - a failed check is a result (pytest.raises' Failed included)
            last = traceback.format_exception_only(type(err), err)[-1].strip()
            records.append({"check": name, "ok": False, "error": last[:400]})
            return None
        records.append({"check": name, "ok": True})
        return result

    return check


def run_script(path: str, workdir: str) -> list[dict[str, Any]]:
    """One process's results of one script: ``[{"check", "ok", "error"?}, ...]`` in call order."""
    os.chdir(workdir)  # scripts write files into the working directory, which all processes must share
    swap_imports()
    source = Path(path).read_text()
    # Imported by its own name from its own directory, so that DataLoader worker processes can import it too
    # (they unpickle the script's dataset classes by reference).
    sys.path.insert(0, str(Path(path).parent))
    module = importlib.import_module(Path(path).stem)
    records: list[dict[str, Any]] = []
    for name in _checks_of(source):
        setattr(module, name, _recorded(getattr(module, name), records))
    try:
        module.main()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - main's own code (outside any check) failed
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        records.append({"check": "main", "ok": False, "error": last[:400]})
    return records


def merge(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per check: ok only if every process passed it; errors of each process that failed."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, records in enumerate(per_rank):
        seen: dict[str, int] = {}
        for record in records:
            count = seen[record["check"]] = seen.get(record["check"], 0) + 1
            key = record["check"] if count == 1 else f"{record['check']} #{count}"
            entry = merged.setdefault(key, {"check": key, "ok": True, "errors": {}})
            if not record["ok"]:
                entry["ok"] = False
                entry["errors"][rank] = record["error"]
    return list(merged.values())


def run(script: str, num_processes: int, timeout: float = 900) -> list[dict[str, Any]]:
    """Run one script on ``num_processes`` processes; the merged check records."""
    from shardkit.distributed import LaunchError, launch

    path = scripts_dir() / f"{script}.py"
    # 90 s: a hung check fails instead of hanging the run, while a peer slowed by a loaded 2-core machine (its start
    # has taken over 20 s here) is still waited for (tests/distributed/harness.py uses the same bound).
    env = {"SHARDKIT_COLLECTIVE_TIMEOUT": "90", "DS_ACCELERATOR": "cpu"}
    try:
        with tempfile.TemporaryDirectory(prefix="accelerate-script-") as workdir:
            per_rank = launch(run_script, args=(str(path), workdir), num_processes=num_processes, timeout=timeout,
                              env=env, in_process=False)
    except LaunchError as err:
        return [{"check": "launch", "ok": False, "errors": {"all": str(err).strip().splitlines()[-1][:400]}}]
    return merge(per_rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=list(DEFAULT_SCRIPTS))
    parser.add_argument("--num-processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {}
    total = passed = 0
    for script in args.scripts:
        for n in args.num_processes:
            if ONLY_ON.get(script, n) != n:
                print(f"{script} on {n} process(es): not run (the script asserts {ONLY_ON[script]} processes)")
                continue
            records = run(script, n)
            results[f"{script}@{n}"] = records
            ok = sum(r["ok"] for r in records)
            total, passed = total + len(records), passed + ok
            print(f"{script} on {n} process(es): {ok}/{len(records)} checks pass", flush=True)
            for r in records:
                if not r["ok"]:
                    reasons = "; ".join(f"rank {k}: {v}" for k, v in r["errors"].items())
                    print(f"  FAIL {r['check']}: {reasons}", flush=True)
    print(f"total: {passed}/{total} checks pass")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
