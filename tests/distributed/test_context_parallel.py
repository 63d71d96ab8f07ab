"""Context parallelism (ring and Ulysses) on 2 and 4 CPU ranks: loss and gradients equal one process's, for
shardkit's Llama (cp 2, cp 4, dp_shard 2 x cp 2 and dp_replicate 2 x cp 2 on 4 ranks) and Hugging Face Llama
and Qwen2 (cp 2).

One launch per world size runs every case in one process group (spawning costs more than a case).
"""

from __future__ import annotations

import pytest
from cp_workers import cp_worker
from harness import run_distributed

CASES = {
    2: [{"cp_mode": "ring"}, {"cp_mode": "ulysses"}, {"hf": "llama", "cp_mode": "ring"},
        {"hf": "qwen2", "cp_mode": "ulysses"}],
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
