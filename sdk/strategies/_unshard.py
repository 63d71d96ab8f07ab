"""Keeping FSDP2's parameters gathered across the decoding steps of one generate call (FSDP and TP's 2-D mesh).

Under FSDP2 every forward all-gathers each unit's parameters and frees them after; a generate call runs one
forward per token. :func:`fsdp_unsharded` gathers every unit once for the whole call when the extra memory
fits, so decoding pays one all-gather per unit instead of one per unit and token, and puts each unit's
reshard behaviour back as it was afterwards. ``MeshStrategy.generation_context`` uses it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["fsdp_unsharded", "free_bytes", "keep_gathered", "unshard_bytes"]

log = logging.getLogger("shardkit.inference")


def unshard_bytes(module: nn.Module) -> int:
    """Extra bytes this rank holds with every parameter gathered (full minus local shard)."""
    return sum((p.numel() - p.to_local().numel()) * p.element_size() for p in module.parameters()
               if isinstance(p, DTensor))


def free_bytes(device: torch.device) -> int:
    """Memory this rank may still use: the device's free memory, or the host's available memory split over
    the ranks of this node."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def keep_gathered(extra: int, device: torch.device, keep: bool | None, any_rank: Callable[[bool], bool],
                  fraction: float = 0.5) -> bool:
    """Whether to hold every parameter gathered for a generate call, the same answer on every rank.

    ``keep`` True/False forces it; None: when ``extra`` (the bytes gathering adds on this rank) fits in ``fraction``
    of the free memory on every rank. ``any_rank`` is the all-reduced "some rank says so": one rank short of
    memory makes every rank gather per layer, so that the ranks' collectives stay the same.
    """
    if keep is None:
        keep = extra <= fraction * free_bytes(device)
    return not any_rank(not keep)


@contextlib.contextmanager
def fsdp_unsharded(module: nn.Module, device: torch.device, keep: bool | None, any_rank: Callable[[bool], bool],
                   fraction: float = 0.5) -> Iterator[str | None]:
    """Keep every FSDP2 unit's parameters gathered for the duration (one all-gather per unit, then none per
    token); yields how parameters are handled, for the log, or None when ``module`` has no FSDP2 unit.

    Args:
        keep: True/False forces the mode; None keeps them gathered when the extra bytes fit in ``fraction``
            of the free memory on every rank.
        any_rank: the all-reduced "some rank says so", so that every rank takes the same decision.
    """
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield None
        return
    extra = unshard_bytes(module)
    if not keep_gathered(extra, device, keep, any_rank, fraction):
        log.info("generate: FSDP parameters are gathered per unit in every forward (keeping them whole needs "
                 "%.1f MiB more per rank than fits)", extra / 2**20)
        yield "FSDP parameters per forward"
        return
    log.info("generate: FSDP parameters kept unsharded across decoding steps (%.1f MiB more per rank)",
             extra / 2**20)
    saved = _save_reshard_state(units)
    try:
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
        for m in units:
            m.unshard()
        yield "FSDP parameters unsharded"
    finally:
        _restore_reshard_state(saved)
        for m in units:
            m.reshard()


def _save_reshard_state(units: list[nn.Module]) -> list[tuple]:
    # NOTE: FSDP2 has a setter for reshard_after_forward but no getter, and the root's value is set at its lazy
    # init; the private fields are read so that each unit gets back exactly what it had (torch 2.13:
    # test_fsdp_and_zero3_hold_parameters_gathered_across_decoding_steps gathers per forward again in its second call
    # only because they were restored).
    saved = []
    for m in units:
        state = m._get_fsdp_state()
        groups = [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]
        saved.append((state, getattr(state, "_auto_reshard_after_forward", None), groups))
    return saved


def _restore_reshard_state(saved: list[tuple]) -> None:
    for state, auto, groups in saved:
        if auto is not None:
            state._auto_reshard_after_forward = auto
        for group, info in groups:
            group.post_forward_mesh_info = info
