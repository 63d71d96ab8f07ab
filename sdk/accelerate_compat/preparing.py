"""What ``Accelerator.prepare`` asks of the objects it is given: what each one is, which model each optimizer
updates, a loader with each process's share of its batch size (``split_batches``), and the order a loader shuffled
with its own generator draws (the same on every process)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from shardkit.accelerate_compat.wrappers import AcceleratedOptimizer, AcceleratedScheduler, PreparedDataLoader
from shardkit.strategies.base import Strategy

__all__ = ["object_kind", "pair_optimizers", "share_generator", "split_batches_loader", "users_order"]


def object_kind(obj: Any) -> str:
    if isinstance(obj, (PreparedDataLoader, DataLoader)):
        return "dataloader"
    if isinstance(obj, nn.Module):
        return "model"
    if isinstance(obj, AcceleratedOptimizer):
        return "other"  # prepared already: returned as it is
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (AcceleratedScheduler, torch.optim.lr_scheduler.LRScheduler)):
        return "scheduler"
    return "other"


def pair_optimizers(models: list[tuple[int, nn.Module]], optimizers: dict[int, Any]) -> dict[int, int]:
    """Optimizer index -> index of the model whose parameters it updates (all of its parameters belong to one)."""
    pairs: dict[int, int] = {}
    for o, optimizer in optimizers.items():
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owner = next((m for m, model in models if params and params <= {id(p) for p in model.parameters()}), None)
        if owner is None:
            raise ValueError(f"prepare() got an optimizer ({type(optimizer).__name__}) whose parameters belong to no "
                             f"model of the same call: pass the model and its optimizer to one prepare() call (ZeRO "
                             f"and FSDP set them up together; an optimizer built before prepare() follows the "
                             f"model's sharding, so there is no need to prepare the model first)")
        if owner in pairs.values():
            raise NotImplementedError("two optimizers over one model: shardkit sets up one optimizer per model; "
                                      "use one optimizer with two parameter groups")
        pairs[o] = owner
    return pairs


def split_batches_loader(loader: DataLoader, processes: int) -> DataLoader:
    """``loader`` with each process's share of its batch size (``split_batches=True``)."""
    size = loader.batch_size
    if size is None or size % processes:
        raise ValueError(f"split_batches=True splits each batch of {size} samples over {processes} processes: use a "
                         f"batch_size that divides by {processes}")
    kwargs = dict(batch_size=size // processes, sampler=loader.sampler, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, drop_last=loader.drop_last, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn)
    if loader.num_workers > 0:
        kwargs.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    return DataLoader(loader.dataset, **kwargs)


def users_order(loader: DataLoader, seedable: bool) -> RandomSampler | None:
    """The sampler of a loader shuffled with its own generator (``DataLoader(shuffle=True, generator=g)``):
    Accelerate draws each epoch's order from it, unless ``use_seedable_sampler`` asks for an order by (seed,
    epoch)."""
    sampler = loader.sampler
    if seedable or type(sampler) is not RandomSampler or sampler.generator is None or sampler.replacement \
            or sampler.num_samples != len(sampler.data_source):
        return None  # shuffled by (seed, epoch), as without a generator
    return sampler


def share_generator(strategy: Strategy, generator: torch.Generator) -> None:
    """Every process takes the main process's generator state, so that they draw the same epoch order."""
    state = strategy.broadcast(generator.get_state().tolist() if strategy.is_global_zero else None, 0)
    generator.set_state(torch.tensor(state, dtype=torch.uint8))
