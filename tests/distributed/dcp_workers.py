"""torch.distributed.checkpoint in and out, in one 2-rank process group.

In: torch's own FSDP2 loop (``fully_shard``, ``get_state_dict``, ``dcp.save``) trains, saves mid-way and goes on;
shardkit resumes the DCP directory under SingleDevice, DDP, FSDP, ZeRO-3 and TP and must continue with the
uninterrupted losses. Out: shardkit under FSDP saves mid-way and goes on; the save is converted to DCP
(``shardkit convert --to dcp``) and torch's own FSDP2 loop (``dcp.load``, ``set_state_dict``) must continue with
shardkit's losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from cp_workers import CONFIG

from shardkit import Runner
from shardkit.models import Llama

__all__ = ["STRATEGIES_IN", "dcp_worker"]

GLOBAL_BATCH, SEQ, STEPS, SAVE_AT = 4, 16, 4, 2
STRATEGIES_IN = ("single", "ddp", "fsdp", "zero3", "tp")


def _batches() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _torch_fsdp() -> tuple[Any, torch.optim.Optimizer]:
    """Torch's own FSDP2 over the world, each decoder layer and the root sharded, with AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _torch_train(model: Any, opt: torch.optim.Optimizer, batches: torch.Tensor) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    losses = []
    for x in batches:
        x = x[rank * per:(rank + 1) * per]
        loss = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _shardkit_strategy(name: str) -> Any:
    from shardkit.strategies.registry import STRATEGIES

    return STRATEGIES.build(name)


def _shardkit_build(name: str) -> tuple[Runner, Any, Any]:
    runner = Runner(_shardkit_strategy(name), seed=0)
    with runner.init_module():
        model = _model()
    model, opt = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return runner, model, opt


def _shardkit_train(runner: Runner, model: Any, batches: torch.Tensor) -> list[float]:
    s = runner.strategy
    per = GLOBAL_BATCH // s.data_parallel_size
    losses = []
    for x in batches:
        x = x[s.data_parallel_rank * per:(s.data_parallel_rank + 1) * per]
        loss = model(x, labels=x)
        runner.backward(loss)
        runner.step()
        losses.append(runner.all_reduce(loss.detach().clone(), "mean").item())
    return losses


def _dcp_in(root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _torch_fsdp()
    batches = _batches()
    _torch_train(model, opt, batches[:SAVE_AT])
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(root / "torch_dcp"))
    out: dict[str, Any] = {"uninterrupted": _torch_train(model, opt, batches[SAVE_AT:])}
    del model, opt
    for name in STRATEGIES_IN:
        runner, smodel, sopt = _shardkit_build(name)
        runner.load(root / "torch_dcp", {"model": smodel, "optimizer": sopt})
        out[name] = {"steps": runner.optimizer_steps, "losses": _shardkit_train(runner, smodel, batches[SAVE_AT:])}
    return out


def _dcp_out(root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardkit.checkpoint.convert import convert

    runner, model, opt = _shardkit_build("fsdp")
    batches = _batches()
    _shardkit_train(runner, model, batches[:SAVE_AT])
    runner.save(root / "shardkit_mid", {"model": model, "optimizer": opt})
    shardkit_losses = _shardkit_train(runner, model, batches[SAVE_AT:])
    if dist.get_rank() == 0:
        convert(root / "shardkit_mid", root / "as_dcp", "dcp")
    dist.barrier()
    tmodel, topt = _torch_fsdp()
    model_sd, optim_sd = get_state_dict(tmodel, topt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(root / "as_dcp"))
    set_state_dict(tmodel, topt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return {"shardkit": shardkit_losses, "torch": _torch_train(tmodel, topt, batches[SAVE_AT:])}


def dcp_worker(root: str) -> dict[str, Any]:
    """Both directions; returns this rank's losses (see the module docstring)."""
    from shardkit.distributed.process_group import init_distributed

    init_distributed("cpu")
    base = Path(root)
    return {"in": _dcp_in(base), "out": _dcp_out(base)}
