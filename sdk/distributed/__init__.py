"""Processes and process groups: launching ranks, joining a job, detecting the cluster.

`shardkit.launch(fn, args, num_processes)` (this package's `launch`, re-exported at the top level) runs
a function on N local processes; `shardkit launch script.py` runs a script through torchrun;
`init_distributed()` joins whichever job the environment describes.

Modules: `launcher` (local ranks from Python or a notebook), `cli`/`supervise`/`signals` (the
`shardkit launch` command), `process_group` (init/destroy, collective timeouts), `cluster` (which
job the environment variables describe: torchrun, SLURM, MPI), `watchdog` (naming a hung rank).
"""

from __future__ import annotations

from shardkit.distributed.cluster import (
    ClusterEnvironment,
    ClusterEnvironmentError,
    detect_environment,
    expand_nodelist,
)
from shardkit.distributed.launcher import GRACE_PERIOD_S, LaunchError, LaunchTimeout, find_free_port, launch
from shardkit.distributed.process_group import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    TIMEOUT_ENV_VAR,
    backend_for_device,
    default_timeout,
    destroy_distributed,
    init_distributed,
)

__all__ = [
    "ClusterEnvironment",
    "ClusterEnvironmentError",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "GRACE_PERIOD_S",
    "LaunchError",
    "LaunchTimeout",
    "TIMEOUT_ENV_VAR",
    "backend_for_device",
    "default_timeout",
    "destroy_distributed",
    "detect_environment",
    "expand_nodelist",
    "find_free_port",
    "init_distributed",
    "launch",
]
