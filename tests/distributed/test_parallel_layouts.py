"""Checkpoints across parallel layouts: saved under cp 2 / pp 2, resumed under cp 1 / pp 1 and back, and with tied
embeddings pp 2 <-> DDP, on 2 CPU ranks; the resumed run continues with the uninterrupted losses (and the tied
weight's optimizer state is the saved one), and ``shardkit zero-to-fp32``'s reader gives the whole model from each
checkpoint."""

from __future__ import annotations

import pytest
from harness import run_distributed
from layout_workers import assert_resumed, layout_worker


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(layout_worker, world_size=2, args=(str(tmp_path_factory.mktemp("layouts")),), timeout=600)


@pytest.mark.parametrize("case", ["cp2->cp1", "cp1->cp2", "pp2->pp1", "pp1->pp2", "tied pp2->ddp",
                                  "tied ddp->pp2"])
def test_resume_under_another_layout_continues_the_uninterrupted_losses(results, case):
    assert_resumed(results, case)
