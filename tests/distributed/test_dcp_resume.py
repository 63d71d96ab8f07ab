"""torch.distributed.checkpoint in and out on 2 CPU ranks, in one launch (see dcp_workers): a DCP save of torch's
own FSDP2 run resumes in shardkit under every family of strategy with the uninterrupted losses, and a shardkit save
converted to DCP resumes in torch's own loop with shardkit's losses."""

from __future__ import annotations

import pytest
import torch
from dcp_workers import SAVE_AT, STRATEGIES_IN, dcp_worker
from harness import run_distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(dcp_worker, world_size=2, args=(str(tmp_path_factory.mktemp("dcp")),), timeout=900)


def _close(got, want, what):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("strategy", STRATEGIES_IN)
def test_torch_dcp_save_resumes_in_shardkit_with_the_uninterrupted_losses(results, strategy):
    for rank, per_rank in enumerate(results):
        got = per_rank["in"][strategy]
        _close(got["losses"], per_rank["in"]["uninterrupted"], f"rank {rank} {strategy}: resumed losses differ")
        assert got["steps"] == SAVE_AT, f"rank {rank} {strategy}: the optimizer's saved step count is not restored"


def test_shardkit_save_converted_to_dcp_resumes_in_torchs_own_loop(results):
    for rank, per_rank in enumerate(results):
        _close(per_rank["out"]["torch"], per_rank["out"]["shardkit"], f"rank {rank}: torch's resumed losses differ")
