"""A private 1-rank group (a plain `python train.py` with FSDP or ZeRO) leaves nothing behind once it ends.

Both were found only by the suite's order on CI: the private group's LOCAL_RANK outlived it and made
transformers' TrainingArguments (through Accelerate's PartialState) wait for a launcher's RANK; and DeepSpeed's
cached clone of a group that had ended made the next ZeRO-3 engine fail with "Group ... is not registered".
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from shardkit import Runner
from shardkit.distributed.process_group import destroy_distributed, init_distributed


def test_the_private_groups_local_rank_ends_with_it(monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    init_distributed("cpu", private_group=True)
    try:
        assert dist.get_world_size() == 1
        assert os.environ.get("LOCAL_RANK") == "0"  # DeepSpeed's zero.Init needs it in a plain process
    finally:
        destroy_distributed()
    assert "LOCAL_RANK" not in os.environ


def test_transformers_arguments_parse_after_a_private_group_ended(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    runner = Runner(strategy="fsdp")
    runner.setup(torch.nn.Linear(4, 4))
    runner.teardown()
    destroy_distributed()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert args.world_size == 1


def test_a_local_rank_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    init_distributed("cpu", private_group=True)
    destroy_distributed()
    assert os.environ.get("LOCAL_RANK") == "0"


@pytest.mark.timeout(300)
def test_a_zero3_engine_after_one_whose_group_ended_without_teardown():
    pytest.importorskip("deepspeed")
    first = Runner(strategy="zero3")
    with first.init_module():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    first.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    destroy_distributed()  # the group ends without first.teardown(): DeepSpeed still holds its clone

    second = Runner(strategy="zero3")
    try:
        with second.init_module():
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        model, optimizer = second.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        losses = []
        for _ in range(5):
            loss = torch.nn.functional.mse_loss(model(x), y)
            second.backward(loss)
            second.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    finally:
        second.teardown()


@pytest.mark.timeout(300)
def test_a_scheduler_made_before_setup_sees_no_override_under_zero(recwarn):
    """torch's schedulers wrap optimizer.step to count its calls; the ZeRO guard around it keeps their mark."""
    pytest.importorskip("deepspeed")
    runner = Runner(strategy="zero2")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        model, optimizer, scheduler = runner.setup(model, optimizer, scheduler)
        for _ in range(2):
            runner.backward(model(torch.randn(4, 8)).square().mean())
            assert runner.step()
        assert not [w for w in recwarn if "overridden after learning rate scheduler" in str(w.message)]
        assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
    finally:
        runner.teardown()


@pytest.mark.timeout(300)
def test_a_hand_called_optimizer_step_under_zero_fails_loudly():
    """Under ZeRO the optimizer holds DeepSpeed's partitions: a step of its own changed no weight, silently."""
    pytest.importorskip("deepspeed")
    runner = Runner(strategy="zero3")
    try:
        with runner.init_module():
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # made after setup: wraps step
        runner.backward(model(torch.randn(4, 8)).square().mean())
        with pytest.raises(RuntimeError, match=r"call runner\.step\(\)"):
            optimizer.step()
        assert runner.step()  # the engine's step still reaches the optimizer, through the scheduler's wrapper
        scheduler.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    finally:
        runner.teardown()
