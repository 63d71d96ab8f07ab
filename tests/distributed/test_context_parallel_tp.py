"""Context parallelism composed with tensor parallelism (cp 2 x tp 2 on 4 CPU ranks): ring and Ulysses attention
over each tp rank's heads give the loss, the gradients and the weights after 2 AdamW steps of one device; HF Llama
and Qwen2 under their own tensor-parallel plans too; head counts that do not fit are refused by name; a checkpoint
saved under cp 2 x tp 2 resumes under cp 1 (and back) with the uninterrupted losses.

One 4-rank launch runs every case (spawning costs more than a case).
"""

from __future__ import annotations

import pytest
from cp_tp_workers import cp_tp_worker
from harness import run_distributed
from layout_workers import assert_resumed

TOL = 2e-5
# AdamW divides by sqrt(v): where a gradient is near zero, ulp-level differences (different reduction orders
# across tp/cp) move a weight by up to lr = 1e-2 in the first steps; 2e-4 on 2 steps still catches any real
# divergence (a wrong gradient moves weights by ~1e-2), as test_tensor_parallel.py bounds TP against DDP.
WEIGHT_TOL = 2e-4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(cp_tp_worker, world_size=4, args=(str(tmp_path_factory.mktemp("cp_tp")),), timeout=600)


@pytest.mark.parametrize("case", ["ring", "ulysses", "ring sequence_parallel", "hf llama ring", "hf qwen2 ulysses"])
def test_cp2_x_tp2_equals_one_device(results, case):
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        assert max(got["loss"]) < TOL, f"rank {rank} {case}: loss differs by {got['loss']}"
        assert max(got["grad"]) < TOL, f"rank {rank} {case}: gradients differ by {got['grad']}"
        assert max(got.get("norm", [0.0])) < TOL, f"rank {rank} {case}: clipped gradient norms differ: {got['norm']}"
        assert got["tp_split"], f"rank {rank} {case}: q_proj is not split over tp"
        if "weights" in got:
            assert got["weights"][0] < WEIGHT_TOL, f"rank {rank} {case}: weights after AdamW differ by {got['weights']}"
            # Evaluation and generation run the whole sequence, still tensor-parallel, with those weights.
            assert got["logits"][0] < WEIGHT_TOL, f"rank {rank} {case}: logits differ by {got['logits']}"
            assert got["generated"], f"rank {rank} {case}: greedy generation differs from one device's"


def test_every_way_of_building_the_model_starts_from_one_devices_weights(results):
    for rank, per_rank in enumerate(results):
        # empty_init=True (weights on rank 0 only) hung in TP's scatter from rank 0 before src_data_rank=None.
        assert all(d == 0.0 for d in per_rank["init"].values()), f"rank {rank}: {per_rank['init']}"


def test_head_counts_that_do_not_fit_are_refused_by_name(results):
    errors = results[0]["errors"]
    assert "num_heads(3) % tp(2) != 0" in errors["heads % tp"], errors
    message = errors["local heads % cp (ulysses)"]
    assert "num_heads(2) / tp(2) % cp(2) != 0" in message and "cp_mode='ring'" in message, message


@pytest.mark.parametrize("case", ["cp2xtp2->cp1", "cp1->cp2xtp2"])
def test_checkpoint_resumes_across_cp_x_tp_and_cp1(results, case):
    assert_resumed(results, case)
