"""Checkpoints across parallel layouts: saved under cp 2 / pp 2, resumed under cp 1 / pp 1 and back, on 2 CPU
ranks; the resumed run continues with the uninterrupted losses, and ``shardkit zero-to-fp32``'s reader gives the
whole model from each checkpoint."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from layout_workers import layout_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(layout_worker, world_size=2, args=(str(tmp_path_factory.mktemp("layouts")),), timeout=600)


@pytest.mark.parametrize("case", ["cp2->cp1", "cp1->cp2", "pp2->pp1", "pp1->pp2"])
def test_resume_under_another_layout_continues_the_uninterrupted_losses(results, case):
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        torch.testing.assert_close(torch.tensor(got["resumed"]), torch.tensor(got["uninterrupted"]), rtol=1e-5,
                                   atol=1e-5, msg=lambda m, r=rank: f"rank {r} {case}: resumed losses differ: {m}")
    assert results[0][case]["consolidated"], f"{case}: zero-to-fp32's reader does not give the saved model"
