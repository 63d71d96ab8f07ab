"""Data-parallel batch inference on 2 CPU ranks: an uneven number of prompts is split across the ranks, generated
under each strategy and gathered back: every prompt's output once, in the prompts' order."""

from __future__ import annotations

import generation_workers as w
import pytest
import torch
from harness import run_distributed

pytest.importorskip("deepspeed")

N_PROMPTS = 5  # odd over 2 ranks: rank 0 gets 3, rank 1 gets 2 (+1 repeat with padding)


def test_uneven_prompts_come_back_once_and_in_order_under_every_strategy():
    names = ["ddp", "zero3", "fsdp", "tp"]
    r0, r1 = run_distributed(w.batch_worker, world_size=2, args=(names, N_PROMPTS), timeout=600)
    for name in names:
        for res in (r0, r1):  # every rank holds the whole gathered list
            each = res[(name, "each")]["gathered"]
            assert len(each) == N_PROMPTS, f"{name}: {len(each)} outputs for {N_PROMPTS} prompts"
            for i, (got, want) in enumerate(zip(each, res["want_each"])):
                assert torch.equal(got, want), f"{name}: output {i} is not prompt {i}'s"
            batched = res[(name, "batched")]["gathered"]
            assert len(batched) == N_PROMPTS
            for i, (got, want) in enumerate(zip(batched, res["want_batched"])):
                assert torch.equal(got, want[0]), f"{name} (one batched call per rank): output {i} is not prompt {i}'s"
        if name == "tp":  # one tensor-parallel group: both ranks take the whole list
            assert r0[(name, "each")]["mine"] == r1[(name, "each")]["mine"] == list(range(N_PROMPTS))
        else:
            assert r0[(name, "each")]["mine"] == [0, 1, 2] and r1[(name, "each")]["mine"] == [3, 4, 4]
            assert r0[(name, "batched")]["mine"] == 3 and r1[(name, "batched")]["mine"] == 2
    assert r0["dict"] == {"a": [1, 2], "b": ["x", "y"]} and r1["dict"] == {"a": [3], "b": ["z"]}


def _one_prompt_two_ranks():
    return w.batch_worker(["zero3"], 1)


def test_fewer_prompts_than_ranks_the_empty_rank_still_joins():
    r0, r1 = run_distributed(_one_prompt_two_ranks, world_size=2, timeout=300)
    for res in (r0, r1):
        assert len(res[("zero3", "each")]["gathered"]) == 1 and len(res[("zero3", "batched")]["gathered"]) == 1
        assert torch.equal(res[("zero3", "each")]["gathered"][0], res["want_each"][0])
    assert r1[("zero3", "batched")]["mine"] == 0 and r1[("zero3", "each")]["mine"] == [0]
