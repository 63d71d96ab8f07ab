"""Pipeline parallelism on 2 and 4 CPU ranks: each schedule's losses and weights equal DDP's (a short accumulation
window included); pp x dp on 4.

One launch per world size runs DDP and every case in one process group.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from pp_workers import pp_worker

SCHEDULES = [{"schedule": "gpipe"}, {"schedule": "1f1b", "microbatches": 4},
             {"schedule": "interleaved_1f1b", "microbatches": 4}, {"schedule": "zero_bubble", "microbatches": 4}]
CASES = {
    # The window case: gradient_accumulation_steps=4 but every window 2 micro-batches long (begin_window), as
    # DDP's 2-micro-batch windows: the pipeline's loss must be scaled by the window, not by 4.
    2: [*SCHEDULES, {"schedule": "1f1b", "accumulation": 2}, {"schedule": "gpipe", "layer_split": (1, 3)},
        {"schedule": "1f1b", "accumulation": 4, "window": 2}],
    4: [{"schedule": "gpipe", "microbatches": 4}, {"schedule": "1f1b", "microbatches": 4},
        {"schedule": "1f1b", "pp_size": 2, "microbatches": 2}, {"schedule": "interleaved_1f1b", "pp_size": 2,
                                                                  "microbatches": 2, "accumulation": 2}],
}
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def results():
    return {world: run_distributed(pp_worker, world_size=world, args=(cases,), timeout=600)
            for world, cases in CASES.items()}


def _window_means(losses: list[float], accumulation: int) -> torch.Tensor:
    return torch.tensor(losses).reshape(-1, accumulation).mean(1)


@pytest.mark.parametrize("world", sorted(CASES))
def test_pipeline_losses_and_weights_equal_ddp(results, world):
    for rank, per_rank in enumerate(results[world]):
        for case, got in per_rank.items():
            if case.startswith("ddp"):
                continue
            accumulation = int(case.rsplit("=", 1)[1])
            ddp = per_rank["ddp" if accumulation == 1 else "ddp_accumulation"]
            # Micro-batches of an accumulation window group rows differently under DDP (per rank) and a
            # pipeline (dp 1): each window's mean is the batch's mean in both.
            torch.testing.assert_close(_window_means(got["losses"], accumulation),
                                       _window_means(ddp["losses"], accumulation), **TOL,
                                       msg=lambda m, c=case, r=rank: f"rank {r} {c}: losses differ from DDP's: {m}")
            assert got["weights"], f"rank {rank} {case}: holds no stage"
            assert len(got["weights"]) < len(ddp["weights"]), f"rank {rank} {case}: holds the whole model"
            for key, value in got["weights"].items():
                torch.testing.assert_close(value, ddp["weights"][key], **TOL,
                                           msg=lambda m, k=key, c=case: f"{c}: {k} differs from DDP's: {m}")
