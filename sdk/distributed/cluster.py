"""Where this process sits in the job: rank, world size and rendezvous address, from the environment.

Three sources, checked in this order:

1. torchrun (and `shardkit.launch`, which sets the same variables): RANK, WORLD_SIZE, LOCAL_RANK,
   LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT.
2. SLURM tasks started by `srun`: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
   SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE), SLURM_JOB_NODELIST, SLURM_JOB_ID.
3. Otherwise a single process.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Literal, Mapping

__all__ = ["ClusterEnvironment", "ClusterEnvironmentError", "detect_environment", "expand_nodelist", "find_free_port"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# NOTE: SLURM gives no port; derive one from the job id so that every task of a job agrees on it
# without talking, and two jobs sharing a node rarely collide (Lightning uses the same rule).
SLURM_PORT_BASE = 15000

Source = Literal["torchrun", "slurm", "single"]


class ClusterEnvironmentError(ValueError):
    """A launcher variable is missing, malformed or inconsistent; the message names it and its value."""


@dataclass(frozen=True)
class ClusterEnvironment:
    """This process's place in the job.

    Attributes:
        rank: global rank, 0 <= rank < world_size.
        local_rank: rank within this node (the CUDA device index on GPU nodes).
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node.
        master_addr: host of rank 0's rendezvous store.
        master_port: port of that store.
        source: which launcher the values came from: "torchrun", "slurm" or "single".
        rendezvous: the launcher named a rendezvous (torchrun's MASTER_PORT) that this process joins even when it
            is the job's only one.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    source: Source = "single"
    rendezvous: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ClusterEnvironmentError(f"world_size({self.world_size}) must be >= 1 (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise ClusterEnvironmentError(f"rank({self.rank}) must be in [0, world_size({self.world_size})) "
                                    f"(from {self.source})")
        if self.local_world_size < 1 or self.local_world_size > self.world_size:
            raise ClusterEnvironmentError(f"local_world_size({self.local_world_size}) must be in "
                                    f"[1, world_size({self.world_size})] (from {self.source})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ClusterEnvironmentError(f"local_rank({self.local_rank}) must be in "
                                    f"[0, local_world_size({self.local_world_size})) (from {self.source})")
        if self.node_rank < 0:
            raise ClusterEnvironmentError(f"node_rank({self.node_rank}) must be >= 0 (from {self.source})")
        if not 0 < self.master_port < 65536:
            raise ClusterEnvironmentError(f"master_port({self.master_port}) must be in [1, 65535] (from {self.source})")

    @property
    def is_distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    @property
    def joins_group(self) -> bool:
        """True when this process joins the launcher's process group: a job of several processes, or one process
        under a launcher that named a rendezvous (torchrun, ``shardkit launch``, ``shardkit.launch``)."""
        return self.is_distributed or self.rendezvous

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def find_free_port(host: str = DEFAULT_MASTER_ADDR) -> int:
    """A TCP port free on `host` right now (the OS picks it; a race with another process is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def detect_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """Read the launcher's variables (torchrun, then SLURM) or fall back to a single process.

    Args:
        environ: the variables to read; `os.environ` when None.

    Raises:
        ClusterEnvironmentError: a variable is malformed; the message names it and its value.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    # NOTE: `salloc` alone sets SLURM_NTASKS but not SLURM_PROCID; only tasks started by `srun` have
    # both, so a notebook inside an allocation stays a single process.
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return ClusterEnvironment()


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ClusterEnvironmentError(f"environment variable {name} is not set; the launcher should set it")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ClusterEnvironmentError(f"environment variable {name}={raw!r} is not an integer") from None


def _from_torchrun(env: Mapping[str, str]) -> ClusterEnvironment:
    rank = _int(env, "RANK")
    world_size = _int(env, "WORLD_SIZE")
    # NOTE: a hand-set RANK/WORLD_SIZE without the local variables is taken as one node.
    local_rank = _int(env, "LOCAL_RANK", rank)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    node_rank = _int(env, "GROUP_RANK", rank // max(local_world_size, 1))
    return ClusterEnvironment(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
        master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        source="torchrun",
        # NOTE: a lone torchrun worker must still join: with TORCHELASTIC_USE_AGENT_STORE any other rendezvous it
        # starts is a client of a store that nobody serves, and it waits for ever. A hand-set RANK/WORLD_SIZE of 1
        # without MASTER_PORT names no rendezvous, and stays a process of its own.
        rendezvous=bool((env.get("MASTER_PORT") or "").strip()),
    )


def _from_slurm(env: Mapping[str, str]) -> ClusterEnvironment:
    rank = _int(env, "SLURM_PROCID")
    world_size = _int(env, "SLURM_NTASKS")
    node_rank = _int(env, "SLURM_NODEID", 0)
    local_rank = _int(env, "SLURM_LOCALID", 0)
    local_world_size = _slurm_tasks_on_node(env, node_rank, world_size)
    if env.get("MASTER_ADDR"):
        master_addr = env["MASTER_ADDR"]
    else:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ClusterEnvironmentError("environment variable SLURM_JOB_NODELIST is not set; it names rank 0's host")
        master_addr = expand_nodelist(nodelist, limit=1)[0]
    if env.get("MASTER_PORT"):
        master_port = _int(env, "MASTER_PORT")
    else:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            raise ClusterEnvironmentError("environment variable SLURM_JOB_ID is not set; set MASTER_PORT instead")
        if not job_id.strip().isdigit():
            raise ClusterEnvironmentError(f"environment variable SLURM_JOB_ID={job_id!r} is not an integer; "
                                    "set MASTER_PORT instead")
        master_port = SLURM_PORT_BASE + int(job_id.strip()[-4:])
    return ClusterEnvironment(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        source="slurm",
    )


def _slurm_tasks_on_node(env: Mapping[str, str], node_rank: int, world_size: int) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE ("2(x3),1"), else 1 per node."""
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = env.get(name)
        if not raw:
            continue
        counts: list[int] = []
        for part in raw.split(","):
            match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
            if match is None:
                raise ClusterEnvironmentError(f"environment variable {name}={raw!r} is not like '4' or '2(x3),1'")
            counts.extend([int(match.group(1))] * int(match.group(2) or 1))
        # A single value applies to every node; a list has one entry per node.
        return counts[0] if len(counts) == 1 else counts[min(node_rank, len(counts) - 1)]
    nodes = _int(env, "SLURM_JOB_NUM_NODES", _int(env, "SLURM_NNODES", 0))
    return world_size // nodes if nodes > 0 and world_size % nodes == 0 else 1


def expand_nodelist(nodelist: str, limit: int | None = None) -> list[str]:
    """Expand SLURM's compressed host list: "node[01-04,07],gpu3" -> node01 ... node04, node07, gpu3.

    Several bracket groups in one name ("rack[1-2]-n[01-02]") expand as a product, zero padding
    is kept, and `limit` stops after that many hosts (a 4096-node list is not built to read one).

    Raises:
        ClusterEnvironmentError: unbalanced brackets or a range that is not "a-b" with a <= b.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        for host in _expand_one(item, nodelist):
            hosts.append(host)
            if limit is not None and len(hosts) >= limit:
                return hosts
    if not hosts:
        raise ClusterEnvironmentError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ClusterEnvironmentError(f"SLURM_JOB_NODELIST={nodelist!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise ClusterEnvironmentError(f"SLURM_JOB_NODELIST={nodelist!r} has unbalanced brackets")
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str, nodelist: str):
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        yield item
        return
    prefix, suffix = item[: match.start()], item[match.end():]
    for part in match.group(1).split(","):
        bounds = part.strip().split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values = [bounds[0]]
        elif len(bounds) == 2 and all(b.isdigit() for b in bounds) and int(bounds[0]) <= int(bounds[1]):
            width = len(bounds[0])
            values = [str(v).zfill(width) for v in range(int(bounds[0]), int(bounds[1]) + 1)]
        else:
            raise ClusterEnvironmentError(f"SLURM_JOB_NODELIST={nodelist!r}: range {part!r} is not 'a' or 'a-b' "
                                          "with a <= b")
        for value in values:
            yield from _expand_one(prefix + value + suffix, nodelist)
