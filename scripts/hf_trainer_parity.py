"""Run Hugging Face's own Trainer tests against HF's Trainer and against shardkit's, and compare.

    python scripts/hf_trainer_parity.py /path/to/hf_tests            # both runs, then the comparison
    python scripts/hf_trainer_parity.py /path/to/hf_tests --only shardkit -k test_event_flow

``/path/to/hf_tests`` is a folder holding a copy of transformers' ``tests/`` package (at least
``tests/__init__.py``, ``tests/trainer/__init__.py`` and the ``tests/trainer/test_*.py`` files to run), taken
from the transformers repository at the version installed here. No test code lives in this repository: fetch
it yourself (see docs/hf_trainer_parity.md).

The shardkit run imports this file as a pytest plugin (``-p hf_trainer_parity`` with ``SHARDKIT_HF_SWAP=1``)
before any test module is collected. It puts shardkit's ``Trainer``, ``TrainingArguments``, ``TrainerState``,
``TrainerControl``, the callback classes and the callback handler in place of transformers' own, in the
top-level ``transformers`` namespace and in the modules that define them, so ``from transformers import
Trainer`` in a test gets shardkit's. The module loggers the tests patch (``transformers.trainer.logger``,
``transformers.trainer_callback.logger``) become shardkit's Trainer logger, and the ``shardkit`` logger becomes a
child of transformers' library logger, so a test that captures or patches a logger sees shardkit's records.
Nothing else of transformers is touched: models, tokenizers, collators, schedulers and ``trainer_utils`` stay HF's.

Each run writes a JUnit XML report; the comparison lists the tests that pass on HF's Trainer and fail on
shardkit's, each with the first line of its failure, and the ones that pass only on shardkit's.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

_SWAP_ENV = "SHARDKIT_HF_SWAP"

# (transformers module, names shardkit provides under the same names)
_SWAPS = {
    "transformers": ("Trainer", "TrainingArguments", "TrainerState", "TrainerControl", "TrainerCallback",
                     "DefaultFlowCallback", "PrinterCallback", "ProgressCallback", "EarlyStoppingCallback"),
    "transformers.trainer": ("Trainer", "TrainingArguments", "TrainerState", "TrainerControl", "TrainerCallback",
                             "DefaultFlowCallback", "PrinterCallback", "ProgressCallback", "CallbackHandler",
                             "ExportableState", "EarlyStoppingCallback"),
    "transformers.trainer_callback": ("TrainerCallback", "TrainerState", "TrainerControl", "CallbackHandler",
                                      "DefaultFlowCallback", "PrinterCallback", "ProgressCallback",
                                      "EarlyStoppingCallback", "ExportableState"),
    "transformers.training_args": ("TrainingArguments",),
}


def swap_into_transformers() -> None:
    """Put shardkit's Trainer classes where transformers keeps its own (see the module docstring)."""
    import importlib

    import shardkit.trainer as sk

    for module_name, names in _SWAPS.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, getattr(sk, name))
    trainer_module = importlib.import_module("transformers.trainer")
    trainer_module.DEFAULT_CALLBACKS = [sk.DefaultFlowCallback]
    shardkit_logger = logging.getLogger("shardkit.trainer")
    for module_name in ("transformers.trainer", "transformers.trainer_callback"):
        importlib.import_module(module_name).logger = shardkit_logger
    # The tests capture transformers' library logger; shardkit's Trainer logger becomes its child, so its records
    # reach those captures (its own level, set from log_level, still decides what it emits).
    logging.getLogger("shardkit").parent = logging.getLogger("transformers")
    # transformers' verbosity is its library's log level, and shardkit's Trainer sets shardkit's from log_level: a
    # test that sets or restores transformers' verbosity (LoggingLevel) sets shardkit's with it.
    hf_logging = importlib.import_module("transformers.utils.logging")
    hf_set_verbosity = hf_logging.set_verbosity

    def set_verbosity(verbosity: int) -> None:
        hf_set_verbosity(verbosity)
        for name in ("shardkit", "shardkit.trainer"):
            logging.getLogger(name).setLevel(verbosity)

    hf_logging.set_verbosity = set_verbosity


if os.environ.get(_SWAP_ENV) == "1":  # imported by pytest as a plugin (-p hf_trainer_parity)
    swap_into_transformers()


def _run(tests: Path, label: str, report: Path, extra: list[str], timeout: int) -> None:
    env = dict(os.environ, TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "pytest", "tests/trainer", "-q", "-p", "no:cacheprovider", "-o",
               "addopts=", "--continue-on-collection-errors", f"--junitxml={report}", "--timeout", str(timeout), *extra]
    if label == "shardkit":
        env[_SWAP_ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                          env.get("PYTHONPATH", "")]))
        command[3:3] = ["-p", "hf_trainer_parity"]
    print(f"== {label}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, cwd=tests, env=env, check=False)


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | error | skipped, first line of the reason)."""
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                text = (node.get("message") or node.text or "").strip().splitlines()
                reason = text[0][:200] if text else ""
                break
        found[name] = (outcome, reason)
    return found


def _compare(hf: dict[str, tuple[str, str]], ours: dict[str, tuple[str, str]]) -> int:
    on_hf = sorted(t for t, (o, _) in hf.items() if o == "passed")
    both = [t for t in on_hf if ours.get(t, ("missing", ""))[0] == "passed"]
    print(f"\npass on HF's Trainer: {len(on_hf)}; of those, pass on shardkit's: {len(both)}")
    for test in on_hf:
        outcome, reason = ours.get(test, ("missing", "not collected"))
        if outcome != "passed":
            print(f"  FAIL {test}: {outcome}: {reason}")
    extra = sorted(t for t, (o, _) in ours.items() if o == "passed" and hf.get(t, ("", ""))[0] != "passed")
    if extra:
        print(f"pass on shardkit's only: {len(extra)}")
        for test in extra:
            print(f"  {test} (HF: {hf.get(test, ('missing', ''))[0]}: {hf.get(test, ('', ''))[1]})")
    return 0 if len(both) == len(on_hf) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_tests", type=Path, help="folder holding transformers' tests/ package")
    parser.add_argument("--only", choices=("hf", "shardkit"), help="run one side (default: both, then compare)")
    parser.add_argument("--reports", type=Path, default=None, help="where the JUnit reports go (default: hf_tests)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test before it counts as failed")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    args = parser.parse_args(argv)
    tests = args.hf_tests.resolve()
    if not (tests / "tests" / "trainer").is_dir():
        parser.error(f"{tests} has no tests/trainer folder: pass the folder that holds transformers' tests/")
    reports = (args.reports or tests).resolve()
    reports.mkdir(parents=True, exist_ok=True)
    extra = ["-k", args.keyword] if args.keyword else []
    sides = [args.only] if args.only else ["hf", "shardkit"]
    for side in sides:
        _run(tests, side, reports / f"junit_{side}.xml", extra, args.timeout)
    if args.only:
        results = _outcomes(reports / f"junit_{args.only}.xml")
        passed = sum(1 for o, _ in results.values() if o == "passed")
        print(f"\n{args.only}: {passed} passed of {len(results)}")
        return 0
    return _compare(_outcomes(reports / "junit_hf.xml"), _outcomes(reports / "junit_shardkit.xml"))


if __name__ == "__main__":
    sys.exit(main())
