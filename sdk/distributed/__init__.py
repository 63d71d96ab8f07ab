"""Processes and process groups: launching ranks, joining a job, detecting the cluster.

`shardkit.launch(fn, args, num_processes)` (this package's `launch`, re-exported at the top level) runs
a function on N local processes; `shardkit launch script.py` runs a script through torchrun;
`init_distributed()` joins whichever job the environment describes.

Modules: `launcher` (local ranks from Python or a notebook), `cli`/`supervise`/`signals` (the
`shardkit launch` command), `hostfile`/`ssh_launch`/`ssh_agent` (`shardkit launch --hostfile`: every host over
ssh), `process_group` (init/destroy, collective timeouts), `cluster` (which
job the environment variables describe: torchrun, SLURM, MPI), `watchdog` (naming a hung rank).
"""

from __future__ import annotations

from shardkit.utils.lazy import lazy_exports

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

# NOTE: each name imports its module on first use, so that `shardkit <command> --help` does not import torch
# (see shardkit.utils.lazy).
_EXPORTS = {
    "ClusterEnvironment": "cluster", "ClusterEnvironmentError": "cluster", "detect_environment": "cluster",
    "expand_nodelist": "cluster", "find_free_port": "cluster",
    "GRACE_PERIOD_S": "launcher", "LaunchError": "launcher", "LaunchTimeout": "launcher", "launch": "launcher",
    "DEFAULT_COLLECTIVE_TIMEOUT_S": "process_group", "TIMEOUT_ENV_VAR": "process_group", "backend_for_device":
    "process_group", "default_timeout": "process_group", "destroy_distributed": "process_group", "init_distributed":
    "process_group",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
