"""Keeping ranks in step while they generate.

Under ZeRO-3, FSDP and tensor parallelism every forward is a collective: each rank's layers gather
(or reduce) their weights with every other rank's. A rank that stops decoding early (EOS, a shorter
``max_new_tokens``, fewer prompts) would leave its peers waiting in the next forward until the
collective timeout. The pieces here make every rank run the same number of forwards:

* :func:`entry_check`: a handshake at the start of a synced call, on a private gloo group with a short
  timeout, so a call made on only some ranks fails in seconds naming the ranks that did not come.
* :func:`any_rank`: the all-reduced "still running" flag, one per decoding step.

How a strategy holds its parameters during the call (FSDP2 keeps them gathered across the decoding steps
when memory allows) is the strategy's business: ``Strategy.generation_context``, which
:func:`shardkit.inference.generate` enters. Whether a module's parameters are partitioned at all is asked of
:func:`shardkit.utils.partitioned.params_partitioned`, which names no engine.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from shardkit.utils.env import seconds_from_env
from shardkit.utils.partitioned import params_partitioned

__all__ = [
    "ENTRY_TIMEOUT_ENV_VAR",
    "NotCalledOnAllRanksError",
    "any_rank",
    "check_group",
    "entry_check",
    "needs_sync",
    "params_partitioned",
]

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
    return seconds_from_env(ENTRY_TIMEOUT_ENV_VAR, DEFAULT_ENTRY_TIMEOUT_S)


def distributed() -> bool:
    """A process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
