"""``notebook_launcher``: Accelerate's signature over :func:`shardkit.launch`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["notebook_launcher"]


def notebook_launcher(function: Callable[..., Any], args: Sequence[Any] = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str | int = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, max_restarts: int = 0,
                      **unsupported: Any) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` local processes forked from this one (a notebook's functions
    need no import), as ``accelerate.notebook_launcher``; the ``Accelerator`` built inside each one joins the job.

    Args:
        function: the training function; build the model once outside and pass it in ``args`` (forked processes
            share it).
        num_processes: default one per visible GPU, else 1 (then ``function`` runs in this process).
        mixed_precision: "no", "fp16" or "bf16" for every ``Accelerator()`` built inside (unless it sets its own).
        use_port: the rendezvous port (Accelerate's default "29500" means: pick a free one).
        master_addr, node_rank, num_nodes: one machine only (``127.0.0.1``, 0, 1); for several machines run
            ``shardkit launch --num-machines N`` on each.
        max_restarts: run ``function`` again on every process after a failure, up to this many times, as
            ``shardkit launch --max-restarts`` restarts a script (a Runner inside resumes from its newest complete
            checkpoint); the same failure twice without progress stops it. Processes are then always forked, one too.
        **unsupported: Accelerate's elastic-rendezvous options (``rdzv_backend``, ``monitor_interval`` ...); refused.

    Returns:
        Each process's return value, in rank order.
    """
    from shardkit.accelerate_compat.plugins import precision_for
    from shardkit.distributed import launch
    from shardkit.distributed.restart import launch_with_restarts

    if unsupported:
        raise NotImplementedError(f"notebook_launcher({', '.join(f'{k}=...' for k in unsupported)}): elastic "
                                  f"launching is not supported; shardkit.launch runs a fixed set of local processes")
    if num_nodes != 1 or node_rank != 0 or master_addr not in ("127.0.0.1", "localhost"):
        raise NotImplementedError("notebook_launcher runs on one machine; for several, run `shardkit launch "
                                  "--num-machines N --machine-rank R --main-process-ip IP script.py` on each")
    precision_for(mixed_precision)  # a bad name fails here, not in every process
    env = {"ACCELERATE_MIXED_PRECISION": str(mixed_precision)}
    if str(use_port) != "29500":
        env["MASTER_PORT"] = str(int(use_port))
    if max_restarts:
        return launch_with_restarts(functools.partial(_fresh, function), tuple(args), max_restarts=max_restarts,
                                    num_processes=num_processes, start_method="fork", env=env)
    return launch(functools.partial(_fresh, function), args=tuple(args), num_processes=num_processes,
                  start_method="fork", env=env)


def _fresh(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with no state inherited from the notebook's process (a forked child starts its own)."""
    from shardkit.accelerate_compat.state import forget_state

    forget_state()
    return function(*args)
