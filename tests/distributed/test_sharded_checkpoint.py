"""FSDP and TensorParallel checkpoints in shardkit's format: exact resume, and sharded saves loaded on another
world size (2 -> 1, 2 -> 4) and under another strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import run_distributed
from test_fsdp import GLOBAL_BATCH, SEQ, TINY, batches, full_weights, make_runner, train
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from shardkit import Runner, SingleDevice
from shardkit import checkpoint as ckpt
from shardkit.distributed import launch
from shardkit.models.llama import Llama

N = 3  # steps before and after the save


def _dataset() -> TensorDataset:
    return TensorDataset(batches(8).reshape(-1, SEQ))  # 32 sequences


def _setup(strategy: str, kwargs: dict, precision: str, seed: int = 0):
    runner = make_runner(strategy, kwargs, precision, seed=seed)
    model = Llama(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runner.setup(model, optimizer)
    return runner, model, optimizer


def _resume_fsdp(path: str, precision: str, phase: str, kwargs: dict) -> list[float]:
    """phase "straight": 2N steps; "first": N steps then save; "second": load, then N steps."""
    runner, model, optimizer = _setup("fsdp", kwargs, precision)
    loader = runner.setup_dataloader(DataLoader(_dataset(), batch_size=GLOBAL_BATCH // 2, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    if phase == "second":
        runner.load(path, state)
    losses = []
    for (x,) in loader:
        loss = model(x, labels=x)
        runner.backward(loss)
        runner.clip_gradients(1.0)
        runner.step()
        losses.append(loss.item())
        if phase == "first" and len(losses) == N:
            runner.save(Path(path) / "step-3", state)  # the loader's position is after N batches
        if len(losses) == (2 * N if phase == "straight" else N):
            break
    return losses


# fp32 with the default sharded state dict: the contract suite's resume check.
@pytest.mark.parametrize("precision,kwargs", [("bf16", {"sharding": "full"}),
                                              ("fp32", {"sharding": "full", "state_dict_type": "full"}),
                                              ("bf16", {"sharding": "full", "state_dict_type": "full"})],
                         ids=["sharded-bf16", "full-fp32", "full-bf16"])
def test_fsdp_exact_resume(tmp_path, precision, kwargs):
    straight = run_distributed(_resume_fsdp, 2, args=(str(tmp_path), precision, "straight", kwargs), timeout=120)
    run_distributed(_resume_fsdp, 2, args=(str(tmp_path), precision, "first", kwargs), timeout=120)
    resumed = run_distributed(_resume_fsdp, 2, args=(str(tmp_path), precision, "second", kwargs), timeout=120)

    for rank in (0, 1):
        assert resumed[rank] == straight[rank][N:], f"rank {rank}: {resumed[rank]} != {straight[rank][N:]}"
    kinds = ckpt.CheckpointReader(tmp_path).entries()
    assert kinds["model"] == ("sharded" if kwargs.get("state_dict_type") != "full" else "tensors")


# TensorParallel's exact resume (and FSDP's with its default sharded state dict in fp32) is checked for every
# strategy by tests/contract/test_strategy_contract.py.


# ---- resharding -----------------------------------------------------------------------------------------


def _full_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[f"{names[id(p)]}/{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).float().cpu().clone()
    return out


def _save(path: str, strategy: str, kwargs: dict) -> dict:
    runner, model, optimizer = _setup(strategy, kwargs, "fp32")
    train(runner, model, optimizer, batches(2), runner.rank, runner.world_size)
    runner.save(Path(path) / "step-2", {"model": model, "optimizer": optimizer})
    return {"weights": full_weights(runner.unwrap_model(model)), "optimizer": _full_optimizer(optimizer, model)}


def _load(path: str, strategy: str, kwargs: dict) -> dict:
    runner, model, optimizer = _setup(strategy, kwargs, "fp32", seed=123)  # a different init, overwritten by load
    runner.load(path, {"model": model, "optimizer": optimizer})
    weights = full_weights(runner.unwrap_model(model))
    state = _full_optimizer(optimizer, runner.unwrap_model(model))
    steps = {float(st["step"]) for st in optimizer.state.values()}
    # One more step must work on the loaded state (optimizer state placed like the parameters).
    train(runner, model, optimizer, batches(1), getattr(runner.strategy, "data_parallel_rank", runner.rank),
          getattr(runner.strategy, "data_parallel_size", runner.world_size))
    return {"weights": weights, "optimizer": state, "steps": steps}


def _assert_same(saved: dict, loaded: dict) -> None:
    assert saved["weights"].keys() == loaded["weights"].keys()
    for k, w in saved["weights"].items():
        assert torch.equal(w, loaded["weights"][k]), k
    assert saved["optimizer"].keys() == loaded["optimizer"].keys()
    for k, v in saved["optimizer"].items():
        assert torch.equal(v, loaded["optimizer"][k]), k
    assert loaded["steps"] == {2.0}


def _save_4(path: str) -> dict:
    return _save(path, "tp", {"tp_size": 2, "dp": "fsdp"})


def test_fsdp_sharded_save_on_2_loads_on_4_and_2d(tmp_path):
    saved = run_distributed(_save, 2, args=(str(tmp_path), "fsdp", {"sharding": "full"}), timeout=120)[0]
    on_4 = run_distributed(_load, 4, args=(str(tmp_path), "fsdp", {"sharding": "full"}), timeout=180)
    on_2d = run_distributed(_load, 4, args=(str(tmp_path), "tp", {"tp_size": 2, "dp": "fsdp"}), timeout=180)
    hybrid = run_distributed(_load, 2, args=(str(tmp_path), "fsdp", {"sharding": "hybrid", "hybrid_shard_size": 1}),
                             timeout=120)

    for loaded in (*on_4, on_2d[0], on_2d[3], hybrid[1]):
        _assert_same(saved, loaded)


def test_2d_sharded_save_on_4_loads_into_fsdp_on_2(tmp_path):
    saved = run_distributed(_save_4, 4, args=(str(tmp_path),), timeout=180)[0]
    loaded = run_distributed(_load, 2, args=(str(tmp_path), "fsdp", {}), timeout=120)

    _assert_same(saved, loaded[1])


def _load_single(path: str) -> dict:
    # SingleDevice's default hooks reassemble a sharded save (any world size) or read a full one.
    runner = Runner(strategy=SingleDevice("cpu"))
    model = Llama(TINY)
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    runner.load(path, {"model": model, "optimizer": optimizer})
    steps = {float(st["step"]) for st in optimizer.state.values()}
    return {"weights": full_weights(model), "optimizer": _full_optimizer(optimizer, model), "steps": steps}


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_fsdp_save_on_2_loads_on_1(tmp_path, state_dict_type):
    saved = run_distributed(_save, 2, args=(str(tmp_path), "fsdp", {"state_dict_type": state_dict_type}),
                            timeout=120)[0]
    loaded = launch(_load_single, args=(str(tmp_path),), num_processes=1, in_process=False, timeout=60)[0]

    _assert_same(saved, loaded)
