"""DeepSpeed's cached process groups, dropped once the group they were cloned from is gone.

DeepSpeed keeps a clone of the world group (and groups made from it) in ``deepspeed.utils.groups``. A second engine
in one process (a second Runner or Trainer, or one built after a group ended without ``teardown``) would otherwise
use a dead clone and fail in its constructor with "Group ... is not registered".
"""

from __future__ import annotations

import sys

__all__ = ["forget_process_groups", "forget_stale_process_groups"]


def forget_stale_process_groups() -> None:
    """Drop DeepSpeed's cached groups when the process group they were cloned from is gone.

    ``teardown`` drops them, but a group can also end without it: an engine never torn down whose process group
    ended some other way (``destroy_distributed`` at the end of a script or test). The next engine would then use
    the dead clone and fail in its constructor with "Group ... is not registered".
    """
    groups = sys.modules.get("deepspeed.utils.groups")
    cached = getattr(groups, "_WORLD_GROUP", None) if groups is not None else None
    if cached is None:
        return
    import torch.distributed as dist

    try:
        live = dist.is_initialized() and dist.get_rank(group=cached) >= 0
    except (ValueError, RuntimeError):  # not registered in the current world: it died with an earlier group
        live = False
    if not live:
        forget_process_groups()


def forget_process_groups() -> None:
    """Drop DeepSpeed's cached groups once the process group is gone (teardown destroys it through torch).

    DeepSpeed keeps a clone of the world group (and groups made from it) in ``deepspeed.utils.groups``; the next
    engine in this process (a second Runner or Trainer after ``teardown``/``end``, with a new group) would use the
    dead clone and fail with "Group ... is not registered". ``deepspeed.comm.destroy_process_group`` drops them too.
    """
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return  # DeepSpeed never ran here
    release = getattr(groups, "_release_process_group_references", None)  # newer DeepSpeed: every cached group
    if release is not None:
        release(None)
    else:
        groups._WORLD_GROUP = None
