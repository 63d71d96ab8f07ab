"""ZeRO checkpoints in shardkit's format: exact resume, other world size and stage, consolidation."""

from __future__ import annotations

import pytest
import torch
import zero_workers as w
from harness import run_distributed

from shardkit.checkpoint import CheckpointReader, consolidate

pytest.importorskip("deepspeed")

STEPS = 4  # as in test_resume.py: 2N steps in one go against N, save, new processes, load, N


STAGES = ["zero1", "zero2", "zero3"]


@pytest.mark.slow  # 2 launches of 2 ranks, every stage in each
# fp32 (losses, weights and the whole next checkpoint, optimizer state included, bitwise after a resume):
# tests/contract/test_strategy_contract.py, every strategy.
@pytest.mark.parametrize("precision", ["bf16"])
def test_exact_resume(tmp_path, precision):
    """test_resume.py's protocol (tiny Llama, dropout, shuffled loader, StepLR, accumulation 2, clipping), for every
    ZeRO stage: one launch trains each stage in one go and, in a fresh engine, half way to its save; new processes
    load each save and train the second half."""
    ckpt = {stage: str(tmp_path / stage / "ckpt") for stage in STAGES}
    runs = [(stage, precision, ckpt[stage], phase) for stage in STAGES for phase in ("full", "first")]
    saved = run_distributed(w.resume_phases, 2, args=(runs, STEPS))
    resumed = run_distributed(w.resume_phases, 2, args=([(s, precision, ckpt[s], "second") for s in STAGES], STEPS))
    for i, stage in enumerate(STAGES):
        for rank in range(2):
            full, first, second = saved[rank][2 * i], saved[rank][2 * i + 1], resumed[rank][i]
            # Bitwise equal on CPU: weights, fp32 masters, Adam moments and step, dropout, data order, LR.
            assert first["losses"] + second["losses"] == full["losses"], f"{stage}, rank {rank}"
            for kind in ("params", "masters", "moments"):
                assert len(second[kind]) == len(full[kind]) > 0, (stage, kind)
                for got, want in zip(second[kind], full[kind]):
                    assert got.numel() > 0 and torch.equal(got, want), f"{stage}, rank {rank}: {kind} differ"
            assert second["steps"] == full["steps"] == 2 * STEPS, stage
        reader = CheckpointReader(tmp_path / stage / "ckpt")
        assert reader.entries()["model"] == "sharded" and reader.entries()["optimizer"] == "sharded", stage


def test_zero3_save_loads_on_one_rank_and_consolidates(tmp_path):
    """2-rank ZeRO-3 save -> consolidate into a plain model, and load on 1 rank as ZeRO-1 and SingleDevice."""
    from safetensors.torch import load_file

    path = str(tmp_path / "ckpt" / "step-2")
    outputs = run_distributed(w.save_and_predict_worker, world_size=2, timeout=600, args=("zero3", path, 2))
    files = consolidate(path, tmp_path / "hf")
    plain = w.make_model(seed=7)
    plain.load_state_dict(load_file(str(files[0])), strict=True)
    with torch.no_grad():
        expected = plain(w.batch(999, 0)[0])
    torch.testing.assert_close(expected, outputs[0], rtol=1e-5, atol=1e-6)
    weights = [p.detach() for p in plain.parameters()]
    assert not torch.equal(weights[0], w.make_model(seed=123)[0].weight), "the load must change the weights"
    zero1 = run_distributed(w.load_params_worker, world_size=1, timeout=600, args=("zero1", path))[0]
    torch.testing.assert_close(zero1["params"], weights, rtol=0, atol=0)
    single = run_distributed(w.load_model_worker, world_size=1, timeout=600, args=("single", path))[0]
    torch.testing.assert_close(single["params"], weights, rtol=0, atol=0)
    torch.testing.assert_close(single["output"], expected, rtol=0, atol=0)
    # the optimizer too, through the base hooks: Adam's step and moments as ZeRO-1 restores them
    assert single["steps"] == [2.0] * len(weights)
    assert all(m.abs().sum() > 0 for m in single["exp_avg"])
    torch.testing.assert_close(single["exp_avg"], zero1["exp_avg"], rtol=0, atol=0)


def test_exact_resume_with_param_groups(tmp_path):
    """AdamW with a decay and a no-decay group (one rank's partition of the latter holds only a parameter
    that never gets a gradient) saves and resumes bitwise under every stage, as one group does."""
    names, groups = ["zero1", "zero2", "zero3"], [1, 2]
    outputs = run_distributed(w.grouped_resume_worker, 2, args=(names, groups, str(tmp_path), 3))
    for rank, output in enumerate(outputs):
        for name in names:
            for count in groups:
                run = output[(name, count)]
                assert len(run["full"]) == 6, (name, count)
                assert run["resumed"] == run["full"], f"rank {rank}, {name}, {count} group(s): the resume differs"
