"""Runner + DDP against raw torch DDP, accumulation, metrics gathering and faults."""

import os
import signal
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from workloads import TINY, build, full_state, train

from shardkit import DDP, Runner
from shardkit.distributed.launcher import LaunchError
from shardkit.distributed.process_group import init_distributed
from shardkit.models import Llama

STEPS = 5


def _batches(rank: int, world: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100)
    data = torch.randint(0, 256, (steps, world * 2, 16), generator=generator)
    return [d[rank * 2 : (rank + 1) * 2] for d in data]


def _raw_ddp() -> dict:
    init_distributed("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(Llama(TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in _batches(rank, world, STEPS):
        model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    # NOTE: the launcher destroys the group after this returns. Destroying it here would leave DDP's reducer
    # the group's last owner, so freeing the model at return would join gloo's workers under the GIL.
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _runner_ddp() -> dict:
    runner = Runner(DDP(), seed=0)
    model = Llama(TINY)
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for ids in _batches(runner.rank, runner.world_size, STEPS):
        runner.backward(model(ids, ids))
        runner.step()
    out = full_state(runner, model)
    runner.teardown()
    return out


def test_runner_ddp_matches_raw_torch_ddp():
    raw = run_distributed(_raw_ddp, 2)
    ours = run_distributed(_runner_ddp, 2)
    for rank in range(2):
        for key, value in raw[rank].items():
            assert torch.equal(ours[rank][key], value), key
    assert not torch.equal(raw[0]["norm.weight"], torch.ones_like(raw[0]["norm.weight"]))  # it trained


def _accumulation() -> dict:
    runner, model, optimizer, _, loader = build("ddp", "fp32", accum=2, dropout=0.0)
    batch = next(iter(loader))
    runner.backward(model(batch["input_ids"], batch["labels"]))
    mid = model.module.lm_head.weight.grad.clone()  # local only: no all-reduce on the first micro-step
    with warnings.catch_warnings(record=True) as caught:  # shardkit's own gather uses torch's current name
        warnings.simplefilter("always")
        synced_mid = runner.all_gather(mid)
    batch = next(iter(loader))
    runner.backward(model(batch["input_ids"], batch["labels"]))
    end = runner.all_gather(model.module.lm_head.weight.grad.clone())
    weights = full_state(runner, model)
    runner.step()
    gathered = {k: runner.all_gather(v) for k, v in full_state(runner, model).items()}
    runner.teardown()
    return {"mid_equal": torch.equal(synced_mid[0], synced_mid[1]), "end_equal": torch.equal(end[0], end[1]),
            "future_warnings": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
            "replicas_equal": all(torch.equal(g[0], g[1]) for g in gathered.values()),
            "changed": any(not torch.equal(weights[k], gathered[k][0]) for k in weights)}


def test_accumulation_skips_sync_until_the_boundary():
    result = run_distributed(_accumulation, 2)[0]
    assert not result["mid_equal"] and result["end_equal"]
    assert result["future_warnings"] == []
    assert result["replicas_equal"] and result["changed"]


def _single_accumulation(accum: int, batch: int) -> list[torch.Tensor]:
    runner = Runner(gradient_accumulation_steps=accum, seed=0)
    model = Llama(TINY)
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    for chunk in ids.split(batch):
        runner.backward(model(chunk, chunk))
        runner.step()
    return list(runner.unwrap_model(model).parameters())


def test_accumulated_micro_batches_equal_one_big_batch():
    big = _single_accumulation(1, 8)
    small = _single_accumulation(2, 4)
    for a, b in zip(big, small):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# An FP16 overflow on one rank skipping the step on every rank and halving the scale: for every strategy in
# tests/contract/test_strategy_contract.py.


def _gather_metrics(strategy: str = "ddp", kwargs: dict | None = None) -> list[int]:
    from shardkit.strategies import strategy_from_name

    runner = Runner(strategy_from_name(strategy, **(kwargs or {})))
    loader = runner.setup_dataloader(DataLoader(TensorDataset(torch.arange(7)), batch_size=2))
    seen = [runner.gather_for_metrics(batch[0]) for batch in loader]
    runner.teardown()
    return torch.cat(seen).tolist()


@pytest.mark.parametrize("strategy,kwargs,world", [("ddp", {}, 2), ("tp", {"tp_size": 2}, 2),
                                                   ("tp", {"tp_size": 2, "dp": "replicate"}, 4)],
                         ids=["ddp", "tp", "tp2x2"])
def test_gather_for_metrics_counts_each_sample_once(strategy, kwargs, world):
    # Under TP the peers of a tensor-parallel group hold the same batch: each sample still counts once, and
    # with 2 data-parallel ranks the padding of 7 samples over 2 is dropped as under DDP.
    for seen in run_distributed(_gather_metrics, world, args=(strategy, kwargs)):
        assert sorted(seen) == list(range(7)), seen


def _crash_mid_step() -> None:
    runner, model, optimizer, _, loader = build("ddp", "fp32")
    train(runner, model, loader, 1)
    if runner.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    train(runner, model, loader, 1)  # rank 0 waits in the gradient all-reduce for a peer that is gone


def test_a_rank_raising_mid_step_ends_the_job_with_its_name():
    from shardkit.distributed import launch

    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1") as err:
        launch(_crash_mid_step, num_processes=2, timeout=90, env={"SHARDKIT_COLLECTIVE_TIMEOUT": "20"})
    assert "injected failure on rank 1" in str(err.value)
    assert time.monotonic() - start < 60


def _killed_mid_save(path: str) -> None:
    runner, model, optimizer, _, loader = build("ddp", "fp32")
    state = {"model": model, "optimizer": optimizer}
    train(runner, model, loader, 1)
    runner.save(f"{path}/step-1", state)
    if runner.rank == 1:
        from shardkit.checkpoint import writer

        original = writer.CheckpointWriter.write_state

        def die(self, *args, **kwargs):  # SIGKILL in the middle of the second save
            os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *args, **kwargs)

        writer.CheckpointWriter.write_state = die
    runner.save(f"{path}/step-2", state)


def _load_latest(path: str) -> int:
    runner, model, optimizer, _, _ = build("ddp", "fp32")
    runner.load(path, {"model": model, "optimizer": optimizer})
    runner.teardown()
    return runner.optimizer_steps


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from shardkit.distributed import launch

    with pytest.raises(LaunchError, match="rank 1"):
        launch(_killed_mid_save, args=(str(tmp_path),), num_processes=2, timeout=90,
               env={"SHARDKIT_COLLECTIVE_TIMEOUT": "20"})
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    assert run_distributed(_load_latest, 2, args=(str(tmp_path),)) == [1, 1]
