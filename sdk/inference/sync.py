"""Keeping ranks in step while they generate.

Under ZeRO-3, FSDP and tensor parallelism every forward is a collective: each rank's layers gather
(or reduce) their weights with every other rank's. A rank that stops decoding early (EOS, a shorter
``max_new_tokens``, fewer prompts) would leave its peers waiting in the next forward until the
collective timeout. The pieces here make every rank run the same number of forwards:

* :func:`entry_check`: a handshake at the start of a synced call, on a private gloo group with a short
  timeout, so a call made on only some ranks fails in seconds naming the ranks that did not come.
* :func:`any_rank`: the all-reduced "still running" flag, one per decoding step.
* :func:`fsdp_unsharded`: under FSDP2, keep the parameters gathered across the decoding steps (one
  all-gather per unit for the whole call, not one per token) when memory allows.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ENTRY_TIMEOUT_ENV_VAR",
    "NotCalledOnAllRanksError",
    "any_rank",
    "check_group",
    "entry_check",
    "fsdp_unsharded",
    "needs_sync",
    "params_partitioned",
]

log = logging.getLogger("shardkit.inference")

ENTRY_TIMEOUT_ENV_VAR = "SHARDKIT_GENERATE_ENTRY_TIMEOUT"
# Seconds the first rank to enter a synced call waits for the others. Ranks reach generation a few
# seconds apart at most after a step or a save (both end in collectives); a call on only some ranks
# waits here instead of for the 30-minute collective timeout.
DEFAULT_ENTRY_TIMEOUT_S = 60.0

_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("shardkit_synced_call", default=False)
_group_cache: dict[int, dist.ProcessGroup] = {}


class NotCalledOnAllRanksError(RuntimeError):
    """A synced call (generation on partitioned weights) was made on only some of the ranks."""


def entry_timeout() -> float:
    """$SHARDKIT_GENERATE_ENTRY_TIMEOUT seconds, else 60."""
    raw = os.environ.get(ENTRY_TIMEOUT_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_ENTRY_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENTRY_TIMEOUT_ENV_VAR}={raw!r} is not a number of seconds; use e.g. 60") from None
    if not value > 0:
        raise ValueError(f"{ENTRY_TIMEOUT_ENV_VAR}={raw!r} must be > 0 seconds")
    return value


def distributed() -> bool:
    """A process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def params_partitioned(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` is split across ranks (a DTensor of FSDP2/TP, a ZeRO-3 partition),
    so that its forward is a collective every rank must join."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) or hasattr(p, "ds_tensor") for p in module.parameters())


def needs_sync(module: nn.Module) -> bool:
    """Ranks must step together: several ranks and partitioned parameters."""
    return distributed() and params_partitioned(module)


def check_group() -> dist.ProcessGroup:
    """A gloo group over every rank with the entry timeout, made once per default group (gloo, whatever the
    default backend: monitored_barrier, which names the missing ranks, exists only in gloo)."""
    world = dist.group.WORLD
    group = _group_cache.get(id(world))
    if group is None:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=entry_timeout()))
        _group_cache.clear()
        _group_cache[id(world)] = group
    return group


def entry_check(what: str) -> dist.ProcessGroup | None:
    """Fail in seconds, not at the collective timeout, when ``what`` was called on only some ranks.

    Returns the gloo group used (for small object exchanges that follow), or None on one rank.

    Raises:
        NotCalledOnAllRanksError: some rank did not enter within the entry timeout.
    """
    if not distributed():
        return None
    timeout = entry_timeout()
    try:
        group = check_group()
        dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        raise NotCalledOnAllRanksError(
            f"{what} must be called on every rank (all {dist.get_world_size()} of them), with the model set up by "
            f"the Runner: its forward is a collective under ZeRO-3, FSDP and tensor parallelism. Rank "
            f"{dist.get_rank()} waited {timeout:g} s ({ENTRY_TIMEOUT_ENV_VAR}) for the others: {err}. Call it "
            "outside `if runner.is_main_process:` and print on the main process afterwards."
        ) from err
    return group


@contextlib.contextmanager
def synced_call(what: str) -> Iterator[bool]:
    """Run the entry check unless an enclosing synced call already did; yields whether this is the outermost."""
    if _inside.get():
        yield False
        return
    entry_check(what)
    token = _inside.set(True)
    try:
        yield True
    finally:
        _inside.reset(token)


def any_rank(flag: bool, device: torch.device) -> bool:
    """The all-reduced "still running" flag: True while any rank still has tokens to produce."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _fsdp_modules(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _unshard_bytes(module: nn.Module) -> int:
    """Extra bytes this rank holds with every parameter gathered (full minus local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.numel() - p.to_local().numel()) * p.element_size() for p in module.parameters()
               if isinstance(p, DTensor))


def _free_bytes(device: torch.device) -> int:
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


@contextlib.contextmanager
def fsdp_unsharded(module: nn.Module, device: torch.device, keep: bool | None = None,
                   fraction: float = 0.5) -> Iterator[str | None]:
    """Under FSDP2, keep every unit's parameters gathered for the duration (one all-gather per unit, then none
    per token); yields the mode used, or None when ``module`` has no FSDP2 unit.

    Args:
        keep: True/False forces the mode; None keeps them gathered when the extra bytes fit in ``fraction``
            of the free memory on every rank (the decision is all-reduced, so every rank takes the same).
    """
    units = _fsdp_modules(module)
    if not units:
        yield None
        return
    extra = _unshard_bytes(module)
    if keep is None:
        keep = extra <= fraction * _free_bytes(device)
    if distributed():
        keep = not any_rank(not keep, device)
    if not keep:
        log.info("generate: FSDP parameters are gathered per unit in every forward (keeping them whole needs "
                 "%.1f MiB more per rank than fits)", extra / 2**20)
        yield "per-forward"
        return
    log.info("generate: FSDP parameters kept unsharded across decoding steps (%.1f MiB more per rank)",
             extra / 2**20)
    saved = _save_reshard_state(units)
    try:
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
        for m in units:
            m.unshard()
        yield "unsharded"
    finally:
        _restore_reshard_state(saved)
        for m in units:
            m.reshard()


def _save_reshard_state(units: list[nn.Module]) -> list[tuple]:
    # NOTE: FSDP2 has a setter for reshard_after_forward but no getter, and the root's value is set at its lazy
    # init; the private fields are read so that each unit gets back exactly what it had.
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
