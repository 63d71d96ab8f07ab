"""benchmarks/scale.py at its smoke size, so that the scale benchmark cannot rot: a tiny Llama built with
runner.init_module() under ZeROInfinity (NVMe swap, BF16) trains 3 steps on one batch of the shipped text
(the loss must fall), generates 3 tokens, and the run's NVMe directory is gone afterwards; the watchdog kills
a run over its memory budget and refuses one over its disk budget before starting it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    # By path, not by putting benchmarks/ on sys.path: its scripts (kernels.py, trainer.py, ...) would shadow
    # real modules for every test that runs after this one.
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # scale.py imports scale_watch by name
    spec.loader.exec_module(module)
    return module


_load("scale_watch")
scale = _load("scale")

pytestmark = pytest.mark.skipif(not scale.libaio_available(), reason="NVMe offload needs libaio (libaio-dev)")


def _runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_trains_generates_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    work, log = tmp_path / "work", tmp_path / "runs.jsonl"
    assert scale.main(["--smoke", "--work-dir", str(work), "--json", str(log)]) == 0
    (run,) = _runs(log)
    assert run["ok"] and run["cfg"]["strategy"] == "zero_infinity", run.get("error")
    losses = run["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert len(run["generated"]["token_ids"]) == 3
    assert run["nvme_bytes_after_steps"] > 0  # the state really went to the NVMe path
    assert run["model_state_bytes"]["optimizer"] >= 0 and run["peak_tree_rss"] > 0
    assert not any(work.glob("run-*")), "the run's NVMe directory was left behind"


def test_watchdog_kills_a_run_over_its_memory_budget_and_refuses_one_over_the_disk_budget(tmp_path):
    args = scale.parse_args(["--proof", "--params", "1e5", "--work-dir", str(tmp_path)])
    cfg = scale._cfg(args)
    tight = scale.Budget(mem_fraction=1e-4)  # ~2.4 MB of 24 GiB: python itself is over it
    result = scale.watched_run(cfg, tight, tmp_path, script=BENCH / "scale.py")
    assert not result["ok"] and "exceeded the memory budget" in result["error"], result
    small_disk = scale.Budget(disk_bytes=1e9)
    result = scale.watched_run({**cfg, "params": 3.3e9}, small_disk, tmp_path, script=BENCH / "scale.py")
    assert not result["ok"] and result["error"].startswith("refused") and "--disk-budget-gb" in result["error"]
    assert not any(tmp_path.glob("run-*"))


def test_runs_get_the_fixed_malloc_mmap_threshold_unless_turned_off(tmp_path):
    # The 2-rank proof fitted under 60% of RAM only with a fixed glibc mmap threshold (README): each run's
    # process must see it, and --malloc-mmap-threshold 0 must leave glibc's default alone.
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, sys\n"
                     "cfg = json.load(open(sys.argv[2]))\n"
                     "json.dump({'threshold': os.environ.get('MALLOC_MMAP_THRESHOLD_')}, open(cfg['result'], 'w'))\n")
    for flag, expected in (([], str(1 << 20)), (["--malloc-mmap-threshold", "0"], None)):
        args = scale.parse_args(["--proof", "--params", "1e5", "--work-dir", str(tmp_path), *flag])
        result = scale.watched_run(scale._cfg(args, strategy="ddp"), scale.Budget(), tmp_path, script=probe)
        assert result["ok"], result
        assert result["threshold"] == expected, (flag, result)
