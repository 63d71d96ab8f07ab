"""Exact resume: 2N steps in one go equal N steps, a save, new processes, a load and N more steps."""

import json

import pytest
import torch
from harness import run_distributed
from workloads import resume_run, resume_runs

STEPS = 4


PRECISIONS = ["fp32", "fp16", "bf16"]


@pytest.mark.parametrize("strategy,world_size", [("single", 1), ("ddp", 2)])
def test_exact_resume(tmp_path, strategy, world_size):
    """Every precision, in two launches: the first trains each in one go and, with a fresh Runner, half way to its
    save; new processes load each save and train the second half."""
    ckpt = {precision: str(tmp_path / precision / "ckpt") for precision in PRECISIONS}
    runs = [(strategy, p, ckpt[p], phase) for p in PRECISIONS for phase in ("full", "first")]
    saved = run_distributed(resume_runs, world_size, args=(runs, STEPS, 2))
    resumed = run_distributed(resume_runs, world_size, args=([(strategy, p, ckpt[p], "second") for p in PRECISIONS],
                                                            STEPS, 2))
    for i, precision in enumerate(PRECISIONS):
        for rank in range(world_size):
            full, first, second = saved[rank][2 * i], saved[rank][2 * i + 1], resumed[rank][i]
            # Bitwise equal on CPU: dropout masks, data order, optimizer moments and LR schedule all resume.
            assert first["losses"] + second["losses"] == full["losses"], (precision, rank)
            for key, value in full["weights"].items():
                assert torch.equal(second["weights"][key], value), (precision, rank, key)
            assert second["scale"] == full["scale"], (precision, rank)
            assert second["steps"] == full["steps"] == 2 * STEPS, (precision, rank)


def test_resume_without_the_rng_state_diverges(tmp_path):
    """The check above can fail: dropping a rank's RNG from the checkpoint changes the losses."""
    ckpt = tmp_path / "ckpt"
    full = run_distributed(resume_run, 1, args=("single", "fp32", None, "full", STEPS, 1))
    run_distributed(resume_run, 1, args=("single", "fp32", str(ckpt), "first", STEPS, 1))
    manifest = ckpt / "step-1" / "shardkit.json"
    data = json.loads(manifest.read_text())
    data["entries"].pop("rng.rank00000")
    manifest.write_text(json.dumps(data))
    second = run_distributed(resume_run, 1, args=("single", "fp32", str(ckpt), "second", STEPS, 1))
    assert second[0]["losses"] != full[0]["losses"][-len(second[0]["losses"]) :]
