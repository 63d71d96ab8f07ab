"""Accelerate's own test scripts against shardkit's Accelerator, imports swapped at run time
(``scripts/run_accelerate_scripts.py``), on 2 processes: ``test_sync.py`` (accumulation, ``no_sync``,
``trigger_sync_in_backward``, the prepared optimizer and scheduler, the data loader's end) and ``test_ops.py``
(gather, broadcast, pad, reduce, the operation checker) pass whole; ``test_script.py`` passes but for the checks in
KNOWN, each with its reason (a check that starts passing fails here too, so that the list stays true); its data
loader checks (``dl_preparation_check``, ``central_dl_preparation_check``, ``custom_sampler_check``,
``check_seedable_sampler_in_batch_sampler_shard``) run through ``shardkit.accelerate_compat.prepare_data_loader``.
``test_distributed_data_loop.py`` (about 6 minutes here) and the 1-process runs are in the script's full run
(docs/accelerate.md); their data loaders are covered by tests/accelerate/test_accelerator_data.py and the 2-rank
``test_data_loaders_accelerate_users_rely_on``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

# Imported by name from scripts/, so that the spawned ranks can import it too.
_SCRIPTS = str(Path(__file__).resolve().parents[2] / "scripts")
if _SCRIPTS not in sys.path:
    sys.path.insert(0, _SCRIPTS)
harness = importlib.import_module("run_accelerate_scripts")

EXPECTED = {
    "test_sync": ["test_dataloader_break", "test_distributed_sync", "test_distributed_sync_multiple_fwd",
                  "test_gradient_accumulation_with_opt_and_scheduler"],
    "test_ops": ["test_gather", "test_gather_object", "test_gather_non_contiguous", "test_broadcast",
                 "test_pad_across_processes", "test_reduce_sum", "test_reduce_mean", "test_reduce_max",
                 "test_op_checker", "test_copy_tensor_to_devices"],
}


KNOWN = {"test_script": {
    "test_reinstantiated_state": "expects Accelerate's AttributeError after AcceleratorState._reset_state() (its "
    "private state); the front's Accelerator keeps working after it",
}}
EXPECTED["test_script"] = [
    "init_state_check", "process_execution_check", "test_split_between_processes_list",
    "test_split_between_processes_nested_dict", "test_split_between_processes_tensor",
    "test_split_between_processes_evenly",
    *(["test_split_between_processes_dataset"] if importlib.util.find_spec("datasets") else []),  # run if installed
    "rng_sync_check", "dl_preparation_check", "central_dl_preparation_check",
    "custom_sampler_check", "check_seedable_sampler", "check_seedable_sampler_with_data_seed",
    "check_seedable_sampler_in_batch_sampler_shard", "training_check(use_seedable_sampler=False)",
    "training_check(use_seedable_sampler=True)", "test_trigger", "test_reinstantiated_state"]


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_accelerates_script_passes_against_the_front(script):
    records = harness.run(script, num_processes=2, timeout=600)
    failed = {r["check"]: r["errors"] for r in records if not r["ok"]}
    assert set(failed) == set(KNOWN.get(script, {})), f"{script}: failed on shardkit's Accelerator: {failed}"
    assert [r["check"] for r in records] == EXPECTED[script]  # every check ran (none skipped by an early error)
