"""Process-group set-up and tear-down: backend from the device, a timeout on every collective."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shardkit.distributed import watchdog
from shardkit.distributed.cluster import ClusterEnvironment, detect_environment, find_free_port
from shardkit.distributed.timeouts import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    MAX_COLLECTIVE_TIMEOUT_S,
    TIMEOUT_ENV_VAR,
    check_timeout,
    cpu_budget,
    default_timeout,
)

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "TIMEOUT_ENV_VAR",
    "MAX_COLLECTIVE_TIMEOUT_S",
    "backend_for_device",
    "check_timeout",
    "cpu_budget",
    "default_timeout",
    "destroy_distributed",
    "init_distributed",
]

# Seconds a process group's worker threads get to drop their last finished work before it is destroyed.
_WORKER_RELEASE_GRACE_S = 0.05
# Variables _start_private_group exported, taken back when the group is destroyed.
_ENV_SET_FOR_PRIVATE_GROUP: set[str] = set()


def backend_for_device(device_type: str) -> str:
    """"nccl" for CUDA (ROCm builds map it to RCCL), "gloo" for everything else."""
    return "nccl" if torch.device(device_type).type == "cuda" else "gloo"


def init_distributed(device_type: str = "cpu", timeout: float | None = None,
                     private_group: bool = False) -> ClusterEnvironment:
    """Detect the environment and join the launcher's process group, or make a private one when asked.

    A job started by a launcher joins its group at any size, one process included (`ClusterEnvironment.joins_group`):
    under torchrun the workers must join the store its agent serves. A process no launcher started gets no group,
    or with ``private_group=True`` a group of one on a free local port (a device mesh and DeepSpeed's engine need a
    group even for one process). Nothing is created when a process group already exists. On CUDA the current device
    becomes `local_rank`. On other devices, when OMP_NUM_THREADS is unset (spawn does not set it; torchrun sets 1),
    each rank gets `cpus // local_world_size` intra-op threads so that N ranks on one machine do not each start one
    thread per core.

    Args:
        device_type: "cuda", "cpu", ... (a device string like "cuda:1" is accepted).
        timeout: seconds any collective may wait for its peers before raising; default
            `default_timeout()`. A crashed peer raises sooner (its sockets close).
        private_group: make a 1-rank group when no launcher started this process (``python train.py``).

    Returns:
        The detected `ClusterEnvironment`.
    """
    # Checked even for one process: a bad value must not wait for the first multi-process run to surface.
    seconds = default_timeout() if timeout is None else check_timeout(timeout, f"timeout({timeout!r})")
    env = detect_environment()
    kind = torch.device(device_type).type
    if kind == "cuda" and torch.cuda.is_available():
        if env.local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local_rank({env.local_rank}) has no CUDA device: only "
                               f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); start fewer processes per node")
        torch.cuda.set_device(env.local_rank)
    if dist.is_available() and dist.is_initialized():
        return env
    if env.joins_group:
        _join_launcher_group(env, kind, seconds)
    elif private_group:
        _start_private_group(kind, seconds)
    return env


def _join_launcher_group(env: ClusterEnvironment, kind: str, seconds: float) -> None:
    if not dist.is_available():
        raise RuntimeError(f"world_size({env.world_size}) under {env.source} but this torch build has no "
                           "torch.distributed")
    if kind != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, cpu_budget() // env.local_world_size))
    # NOTE: env:// rather than tcp://: under torchrun the workers must join the agent's store
    # (TORCHELASTIC_USE_AGENT_STORE), which only the env:// rendezvous knows about.
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group(
        backend=backend_for_device(kind),
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=seconds),
    )
    watchdog.install_excepthook(seconds)


def _start_private_group(kind: str, seconds: float) -> None:
    """A 1-rank group on a free local port, for a process no launcher started (a plain ``python train.py``)."""
    if not dist.is_available():
        raise RuntimeError("this strategy needs a process group, and this torch build has no torch.distributed")
    dist.init_process_group(backend_for_device(kind), init_method=f"tcp://127.0.0.1:{find_free_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=seconds))
    # DeepSpeed's zero.Init reads os.environ["LOCAL_RANK"] and fails with KeyError in a plain `python train.py`,
    # which no launcher has given it (the only rank variable DeepSpeed requires). Taken back with the group: left
    # set, it tells the next library in this process (Accelerate's PartialState, which transformers'
    # TrainingArguments builds) that a launcher started it, and that one then waits for a RANK no one gave.
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = "0"
        _ENV_SET_FOR_PRIVATE_GROUP.add("LOCAL_RANK")


def destroy_distributed() -> None:
    """Drain and destroy the default process group if one exists (safe to call twice).

    NOTE: the barrier lets every earlier collective finish before the group goes (with the GIL
    released while waiting). gloo's worker thread frees finished work, and freeing the last reference
    to a tensor Python created needs the GIL, so callers also keep their collectives' tensors alive
    until after this returns (ProcessGroupStrategy._held): destroying a group joins that thread while holding the
    GIL. A dead peer makes the barrier fail fast.

    Raises:
        CollectiveTimeoutError: a peer is alive but never reached the barrier (it hangs after its last
            collective); the message names it. The group is not destroyed then.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    timed_out = None
    if dist.get_world_size() > 1:
        try:
            dist.barrier()
        except Exception as err:  # noqa: BLE001 - a peer is gone: nothing left to drain
            if watchdog.is_collective_timeout(err):
                rank, missing = dist.get_rank(), watchdog.missing_ranks()
                timed_out = watchdog.CollectiveTimeoutError(
                    watchdog.describe(rank, missing, "the final barrier (destroy_distributed)"), missing)
        # NOTE: gloo's worker drops the work it ran last (the barrier, which references the earlier works and
        # so their tensors) a moment after that work completes. Give it the moment, with the GIL released,
        # before anything can free the last Python reference to those tensors: freed first, the worker's
        # release needs the GIL, and a group destroyed under the GIL (by DDP's reducer) joins that worker. An
        # exit deadlock seen on the loaded 2-core CI machine.
        time.sleep(_WORKER_RELEASE_GRACE_S)
    if timed_out is not None:
        # NOTE: swallowed, this would let a rank exit 0 while its peer hangs for ever. The group is left
        # to process exit: this rank ends on the error, and its closing sockets end the peer's next collective.
        raise timed_out
    dist.destroy_process_group()
    while _ENV_SET_FOR_PRIVATE_GROUP:
        os.environ.pop(_ENV_SET_FOR_PRIVATE_GROUP.pop(), None)
