"""Bytes of model state one rank holds under ZeRO, by kind: ``ZeRO*.model_state_bytes`` (every strategy has it).

What is counted (each storage once, whole, wherever it lives: device or host):

* ``params``: the parameters the model computes with (fp32, or bf16/fp16 under mixed precision).
  Stage 1/2: every rank holds them whole. Stage 3: the rank's partition (``ds_tensor``), plus
  the small parameters kept whole (``ds_persist``) and any still gathered (the stage's layout says which).
* ``grads``: gradient buffers of the parameters and of the fp32 master partition, DeepSpeed's
  reduction buckets and its partitioned-gradient buffers.
* ``optimizer``: the fp32 master partition and the optimizer's states (``exp_avg``,
  ``exp_avg_sq``), i.e. the paper's "12Ψ/N" in mixed precision.

Under FP32 DeepSpeed still keeps a separate fp32 master partition, so ZeRO-1/2 measure
4Ψ + 4Ψ + 12Ψ/N rather than the paper's 4Ψ + 4Ψ + 8Ψ/N (the paper counts the fp32 parameters once).
States swapped out to NVMe are not held and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardkit.strategies.zero.layout import ZeROLayout

__all__ = ["model_state_bytes"]


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class _Counter:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in self.seen:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        return total


def model_state_bytes(module: nn.Module, optimizer: Any, layout: ZeROLayout) -> dict[str, int]:
    """``{"params": ..., "grads": ..., "optimizer": ...}`` in bytes for this rank (see the module docstring)."""
    counter = _Counter()
    inner = getattr(optimizer, "optimizer", optimizer)
    masters = list(getattr(optimizer, "single_partition_of_fp32_groups", None)
                   or getattr(optimizer, "fp32_partitioned_groups_flat", None) or [])
    # The optimizer first, so that a parameter aliasing a master (fp32 without a copy) is counted once.
    # An inference engine's "optimizer" (DeepSpeedZeRoOffload, or None below stage 3) has no state.
    state = getattr(inner, "state", None) or {}
    opt_bytes = counter.add(masters) + counter.add(_tensors(list(state.values())))
    params = list(module.parameters())
    param_bytes = counter.add(layout.held_parameters(params))
    grads = [p.grad for p in params if p.grad is not None] + [m.grad for m in masters if m.grad is not None]
    # NOTE: DeepSpeed 0.19.8 names; stage 2 keeps the reduced partition between micro-batches in
    # all_grad_tensors, and the reduction buckets in ipg_buckets[dtype].buffer.
    buckets = [b.buffer for b in getattr(optimizer, "ipg_buckets", {}).values()]
    grads.extend(_tensors(buckets))
    for attr in ("grads_in_partition", "averaged_gradients", "all_grad_tensors", "ipg_buffer",
                 "grad_partitions_flat_buffer", "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer"):
        grads.extend(_tensors(getattr(optimizer, attr, None)))
    return {"params": param_bytes, "grads": counter.add(grads), "optimizer": opt_bytes}
