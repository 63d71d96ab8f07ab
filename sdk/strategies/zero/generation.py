"""ZeRO-3's parameters held gathered for one generate call, so decoding does not all-gather them per token.

A DeepSpeed engine's hooks gather a module's partitions before its forward and partition them again after it once no
submodule uses them any more (the parameter's ``ds_active_sub_modules`` is empty). A generate call runs one forward
per token, so by default every decoding step all-gathers the whole model, layer by layer. :func:`zero3_gathered`
gathers every partitioned parameter once (DeepSpeed's all-gather of a parameter list, as ``GatheredParameters``
does) and counts the call as one more user of each parameter for its duration: the hooks then find every parameter
available (nothing to fetch) and leave it whole after each module (a user remains). On exit the parameters are
partitioned again, as they were, so training goes on as if no generation had run. The hooks stay in place (what
they still do per module is bookkeeping, no collective): the engine's trace and module ids are untouched.

Held per layer instead (the engine's hooks, as without this context):
- when the whole model does not fit (the FSDP rule, :func:`shardkit.strategies._unshard.keep_gathered`);
- under NVMe parameter offload (ZeROInfinity's default): DeepSpeed swaps partitions in through a fixed pool of
  ``buffer_count`` buffers along the recorded trace, one per parameter in flight, so the whole model cannot be
  swapped in at once (and a model put on NVMe is one that is not meant to be whole in memory);
- with ``stage3_module_granularity_threshold`` set: after a leaf module's forward the hooks then replace its
  parameters' data with an empty buffer whether or not someone still uses them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardkit.strategies._unshard import keep_gathered

__all__ = ["GENERATION_HOLDER", "per_layer", "per_layer_reason", "zero3_gathered"]

log = logging.getLogger("shardkit.inference")

# The name the call is counted under among a parameter's users (``ds_active_sub_modules`` holds the users' module ids,
# ints; a string cannot collide with one).
GENERATION_HOLDER = "shardkit.generate"


def _partitioned(module: nn.Module) -> list[nn.Parameter]:
    """The module's ZeRO-3 parameters that are partitioned now, in ``ds_id`` order (the same order on every rank, so
    the ranks' gathers match). Parameters already whole (persistent small ones, or one in flight) are left to the
    hooks."""
    params = {id(p): p for p in module.parameters()
              if hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"}
    return sorted(params.values(), key=lambda p: p.ds_id)


def _gather_bytes(params: list[nn.Parameter], device: torch.device) -> int:
    """Bytes gathering adds on this rank: each whole parameter, less its partition where that already lives on
    ``device`` (an offloaded partition stays where it is)."""
    total = 0
    for p in params:
        total += p.ds_numel * p.element_size()
        local = p.ds_tensor
        if local is not None and local.device == device:
            total -= local.numel() * local.element_size()
    return total


def per_layer_reason(offload_params: str | None, granularity_threshold: int) -> str | None:
    """Why the parameters must stay per layer whatever the memory, or None."""
    if offload_params == "nvme":
        return ("parameters are offloaded to NVMe (DeepSpeed swaps them in through buffer_count buffers, a few "
                "parameters at a time)")
    if granularity_threshold > 0:
        return ("stage3_module_granularity_threshold is set (DeepSpeed's hooks then empty a leaf module's "
                "parameters after its forward even while they are held)")
    return None


def per_layer(reason: str, keep: bool | None) -> contextlib.AbstractContextManager[str]:
    """The engine's hooks alone (per layer) for a ``reason`` from :func:`per_layer_reason`.

    Raises:
        ValueError: ``keep=True``, which cannot be honoured.
    """
    if keep:
        raise ValueError(f"generate: keep_unsharded=True cannot hold ZeRO-3's parameters gathered: {reason}. "
                         "Leave keep_unsharded unset (per layer here), or offload parameters to the CPU instead")
    return contextlib.nullcontext(f"ZeRO-3 parameters gathered per layer in every forward ({reason})")


@contextlib.contextmanager
def zero3_gathered(module: nn.Module, device: torch.device, keep: bool | None, any_rank: Callable[[bool], bool],
                   fraction: float = 0.5) -> Iterator[str]:
    """Hold every ZeRO-3 parameter of ``module`` gathered for the duration (one gather, then none per token); yields
    how parameters are handled, for the log.

    Args:
        keep: True/False forces the mode; None holds them when the extra bytes fit in ``fraction`` of the free memory
            on every rank.
        any_rank: the all-reduced "some rank says so", so that every rank takes the same decision.
    """
    params = _partitioned(module)
    extra = _gather_bytes(params, device)
    if not keep_gathered(extra, device, keep, any_rank, fraction):
        why = ("keep_unsharded=False" if keep is False
               else f"holding them whole needs {extra / 2**20:.1f} MiB more per rank than fits on some rank")
        log.info("generate: ZeRO-3 parameters are gathered per layer in every forward (%s)", why)
        yield f"ZeRO-3 parameters gathered per layer in every forward ({why})"
        return
    log.info("generate: ZeRO-3 parameters gathered once for the call (%.1f MiB more per rank)", extra / 2**20)
    if not params:
        yield "ZeRO-3 parameters gathered once for the call"
        return
    params[0].all_gather(param_list=params)  # a collective: every rank has the same list (see _partitioned)
    for p in params:
        p.ds_active_sub_modules.add(GENERATION_HOLDER)
    try:
        yield "ZeRO-3 parameters gathered once for the call"
    finally:
        for p in params:
            p.ds_active_sub_modules.discard(GENERATION_HOLDER)
        # A call that failed inside a forward leaves that module's parameters in use: the engine releases those at
        # its next forward, and partitioning them here would free memory a module still points at.
        idle = [p for p in params if not p.ds_active_sub_modules and p.ds_status.name == "AVAILABLE"]
        if idle:
            idle[0].partition(param_list=idle, has_been_updated=False)
