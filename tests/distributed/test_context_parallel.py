"""Context parallelism (ring and Ulysses) on 2 and 4 CPU ranks: loss and gradients equal one process's, for
shardkit's Llama (cp 2, cp 4, dp_shard 2 x cp 2 and dp_replicate 2 x cp 2 on 4 ranks) and Hugging Face Llama
and Qwen2 (cp 2). The 2-rank launch also runs the MoE Llama under cp 2, tp 2 and a pipeline of 2 stages against
one device: the loss with its auxiliary loss, the gradients, the expert counts and the router biases after the
aux-loss-free update.

One launch per world size runs every case in one process group (spawning costs more than a case).
"""

from __future__ import annotations

import pytest
from cp_workers import cp_worker
from harness import run_distributed

CASES = {
    2: [{"cp_mode": "ring"}, {"cp_mode": "ulysses"}, {"hf": "llama", "cp_mode": "ring"},
        {"hf": "qwen2", "cp_mode": "ulysses"},
        {"moe": ["moe cp ring", "moe tp", "moe tp sequence_parallel", "moe pp", "moe pp zbv"]}],
    4: [{"cp_mode": "ring"}, {"cp_mode": "ulysses"}, {"cp_mode": "ring", "cp_size": 2},
        {"cp_mode": "ulysses", "cp_size": 2}, {"cp_mode": "ring", "cp_size": 2, "dp_replicate": 2}],
}
TOL = 2e-5


@pytest.fixture(scope="module")
def results():
    out = {}
    for world, cases in CASES.items():
        out[world] = run_distributed(cp_worker, world_size=world, args=(cases,), timeout=600)
    return out


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_loss_and_gradients_equal_one_process(results, world):
    for rank, per_rank in enumerate(results[world]):
        for case, got in per_rank.items():
            assert max(got["loss"]) < TOL, f"rank {rank} {case}: loss differs by {got['loss']}"
            assert max(got["grad"]) < TOL, f"rank {rank} {case}: gradients differ by {got['grad']}"


@pytest.mark.parametrize("case", ["moe cp ring", "moe tp", "moe tp sequence_parallel", "moe pp", "moe pp zbv"])
def test_moe_llama_equals_one_device(results, case):
    """cp 2: each rank routes its chunk, the load and the auxiliary loss summed over the cp group; tp 2: the router
    and experts whole on each rank, the auxiliary loss counted once; pp 2 (1f1b, and zbv's split backward): each
    stage's auxiliary loss started in its own backward, each micro-batch's statistics its own (the reference
    accumulates the same two micro-batches)."""
    for rank, per_rank in enumerate(results[2]):
        got = per_rank[case]
        assert got["layers"], f"rank {rank} {case}: no MoE layer on this rank"
        assert max(got["loss"]) < TOL, f"rank {rank} {case}: loss (with the aux loss) differs by {got['loss']}"
        assert max(got["grad"]) < TOL, f"rank {rank} {case}: gradients differ by {got['grad']}"
        assert max(got["counts"]) == 0, f"rank {rank} {case}: expert counts differ by {got['counts']}"
        assert max(got["bias"]) == 0, f"rank {rank} {case}: router biases differ by {got['bias']}"
        if "pp" not in case:  # evaluation without labels: the whole sequence on every rank, routed as on one device
            assert got["eval"][0] < TOL and got["eval"][1] == 0, f"rank {rank} {case}: logits, load: {got['eval']}"
