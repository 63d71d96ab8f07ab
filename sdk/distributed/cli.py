"""`shardkit launch`: run a script on N processes per machine through torchrun's static rendezvous.

    shardkit launch --num-processes 4 train.py --lr 1e-3
    shardkit launch --num-machines 2 --machine-rank 0 --main-process-ip 10.0.0.1 -m mypkg.train
    shardkit launch --hostfile hosts.txt train.py          # every host of a DeepSpeed hostfile, over ssh
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

from shardkit.distributed.cluster import find_free_port
from shardkit.distributed.restart import add_restart_flags, check_restart_flags, run_with_restarts
from shardkit.distributed.restart_records import RESTART_VARIABLES
from shardkit.distributed.signals import STOP_GRACE_S
from shardkit.distributed.ssh_launch import add_hostfile_flags, run_hostfile_launch
from shardkit.distributed.timeouts import TIMEOUT_ENV_VAR, check_timeout, cpu_budget, default_timeout

__all__ = ["CONFIG_FIELDS", "DEFAULT_CONFIG_FILE", "LaunchUsageError", "build_command", "register"]

DEFAULT_MAIN_PROCESS_PORT = 29500
MAX_PROCESSES_ENV_VAR = "SHARDKIT_MAX_PROCESSES"
# What `shardkit config` writes by default and `shardkit launch` reads when no --config-file is given.
DEFAULT_CONFIG_FILE = "shardkit_config.yaml"
# The keys `shardkit.config.accelerate.launch_args_from_yaml(path)` may return; values given on the
# command line win over the file's. "env" is a dict of extra variables for every rank.
CONFIG_FIELDS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                 "timeout", "env", "hostfile", "include", "exclude")


class LaunchUsageError(ValueError):
    """The launch arguments are inconsistent; the message names the flag and the fix."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `shardkit launch`."""
    # NOTE: allow_abbrev=False, as accelerate launch: everything after the script is the script's, and argparse would
    # otherwise read a script's --fsdp or --mixed as an abbreviation of a launcher flag ("ambiguous option").
    parser = subparsers.add_parser(
        "launch", help="run a script on N processes and M machines (torchrun)", allow_abbrev=False,
        description="Run SCRIPT (or -m MODULE) on --num-processes processes on each of --num-machines "
                    "machines through torchrun. The script calls shardkit.distributed.init_distributed() or builds "
                    "a Runner. Every argument after SCRIPT is passed to it unchanged. The exit code is the job's.")
    parser.add_argument("--num-processes", "--num_processes", type=int, dest="num_processes",
                        help="processes per machine (default: one per visible CUDA device, else 1; at most 4 per "
                             "CPU core unless SHARDKIT_MAX_PROCESSES is set)")
    parser.add_argument("--num-machines", "--num_machines", type=int, dest="num_machines", help="default 1")
    parser.add_argument("--machine-rank", "--machine_rank", type=int, dest="machine_rank",
                        help="index of this machine, 0 on the one with the main process (default 0)")
    parser.add_argument("--main-process-ip", "--main_process_ip", dest="main_process_ip",
                        help="address of machine 0 (required with --num-machines > 1)")
    parser.add_argument("--main-process-port", "--main_process_port", type=int, dest="main_process_port",
                        help=f"port on machine 0 (default: a free one on a single machine, else "
                             f"{DEFAULT_MAIN_PROCESS_PORT})")
    parser.add_argument("--timeout", help=f"collective timeout in seconds (sets {TIMEOUT_ENV_VAR}; default 1800). "
                                          "A rank still running this long plus a grace after another exited is "
                                          "taken as hung and the job is stopped")
    parser.add_argument("--stop-grace", "--stop_grace", dest="stop_grace", default=str(STOP_GRACE_S),
                        help=f"seconds ranks get to save after SIGTERM/SIGINT reaches the launcher (forwarded to "
                             f"them as SIGTERM) before everything is killed (default {STOP_GRACE_S:g})")
    parser.add_argument("--config-file", "--config_file", dest="config_file",
                        help="an Accelerate-style YAML file supplying the options above (default: "
                             "./shardkit_config.yaml, what `shardkit config` writes, when it exists)")
    add_restart_flags(parser)
    _config_flags().add_config_flags(parser)
    add_hostfile_flags(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    parser.add_argument("script", help="the training script (or module name with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(func=_run)


def _config_flags() -> Any:
    # NOTE: imported by name: config sits above distributed in the package graph (it builds strategies).
    return importlib.import_module("shardkit.config.launch_flags")


def _flags_to_config_file(args: argparse.Namespace) -> Path | None:
    """Lay Accelerate's config-as-flags over --config-file (the default file already chosen) and point
    --config-file at the result; returns the temporary file to remove after the launch, None without flags."""
    total = args.num_processes * (args.num_machines or 1) if args.num_processes else None
    base = Path(args.config_file) if args.config_file else None
    written = _config_flags().write_flags_config(args, base, total)
    if written is not None:
        args.config_file = str(written)
    return written


def _apply_config_file(args: argparse.Namespace) -> dict[str, str]:
    """Fill options not given on the command line from --config-file; return its extra variables."""
    try:
        accelerate = importlib.import_module("shardkit.config.accelerate")
    except ModuleNotFoundError as err:
        if err.name not in ("shardkit.config", "shardkit.config.accelerate"):
            raise
        raise LaunchUsageError("--config-file: config files arrive with the config module "
                               "(shardkit.config.accelerate); pass the options as flags for now") from None
    try:
        values: Mapping[str, Any] = accelerate.launch_args_from_yaml(args.config_file)
    except LaunchUsageError:
        raise
    except Exception as err:  # noqa: BLE001 - one line naming the file, never a traceback
        raise LaunchUsageError(f"--config-file {args.config_file}: {type(err).__name__}: {err}") from None
    unknown = sorted(set(values) - set(CONFIG_FIELDS))
    if unknown:
        raise LaunchUsageError(f"--config-file {args.config_file}: launch_args_from_yaml returned unknown "
                               f"keys {unknown}; expected some of {list(CONFIG_FIELDS)}")
    for key, value in values.items():
        if key != "env" and getattr(args, key) is None:
            setattr(args, key, value)
    return {str(k): str(v) for k, v in (values.get("env") or {}).items()}


def _resolve(args: argparse.Namespace) -> None:
    """Fill defaults and check the combination; raises LaunchUsageError naming the flag."""
    if args.num_processes is None:
        import torch

        args.num_processes = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    args.num_machines = 1 if args.num_machines is None else args.num_machines
    args.machine_rank = 0 if args.machine_rank is None else args.machine_rank
    if args.num_processes < 1:
        raise LaunchUsageError(f"--num-processes({args.num_processes}) must be >= 1")
    _check_process_count(args.num_processes)
    if args.num_machines < 1:
        raise LaunchUsageError(f"--num-machines({args.num_machines}) must be >= 1")
    if not 0 <= args.machine_rank < args.num_machines:
        raise LaunchUsageError(f"--machine-rank({args.machine_rank}) must be in [0, "
                               f"--num-machines({args.num_machines}))")
    if args.num_machines > 1 and not args.main_process_ip:
        raise LaunchUsageError(f"--num-machines({args.num_machines}) > 1 needs --main-process-ip, the address of "
                               "machine 0, the same on every machine")
    if args.main_process_ip is None:
        args.main_process_ip = "127.0.0.1"
    if args.main_process_port is None:
        single = args.num_machines == 1
        args.main_process_port = find_free_port() if single else DEFAULT_MAIN_PROCESS_PORT
    if not 0 < args.main_process_port < 65536:
        raise LaunchUsageError(f"--main-process-port({args.main_process_port}) must be in [1, 65535]")
    try:
        if args.timeout is not None:
            args.timeout = check_timeout(args.timeout, _label("--timeout", args.timeout))
        args.stop_grace = check_timeout(args.stop_grace, _label("--stop-grace", args.stop_grace))
    except ValueError as err:
        raise LaunchUsageError(str(err)) from None
    if not args.module and not Path(args.script).is_file():
        raise LaunchUsageError(f"script {args.script!r} not found (use -m for a module name)")


def _check_process_count(count: int) -> None:
    """Refuse more local ranks than this machine can run: 4 per core it may use, or SHARDKIT_MAX_PROCESSES."""
    raw = os.environ.get(MAX_PROCESSES_ENV_VAR, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise LaunchUsageError(f"{MAX_PROCESSES_ENV_VAR}={raw!r} must be a whole number >= 1")
        limit, why = int(raw), f"{MAX_PROCESSES_ENV_VAR}={raw}"
    else:
        # NOTE: every rank is a Python process holding torch (~300 MB) and its model; at 4 per core a 2-core
        # machine already spends most of its time switching between 8 of them.
        cores = cpu_budget()
        limit, why = 4 * cores, f"4 per core this process may use ({cores})"
    if count > limit:
        raise LaunchUsageError(f"--num-processes({count}) is more processes than this machine runs: the limit is "
                               f"{limit}, {why}. To start them anyway set {MAX_PROCESSES_ENV_VAR}={count}")


def _default_config_file() -> str | None:
    """``./shardkit_config.yaml`` (what ``shardkit config`` writes) when it exists, as Accelerate's default file."""
    if not Path(DEFAULT_CONFIG_FILE).is_file():
        return None
    print(f"shardkit launch: using ./{DEFAULT_CONFIG_FILE} (written by `shardkit config`); flags given here win "
          f"over it, --config-file picks another file", file=sys.stderr)
    return DEFAULT_CONFIG_FILE


def _label(flag: str, raw: Any) -> str:
    try:
        return f"{flag}({float(raw)})"
    except (TypeError, ValueError):
        return f"{flag}({raw!r})"


def build_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line for resolved `args` (static rendezvous, no restarts; see `_torchrun`)."""
    command = [sys.executable, "-m", "shardkit.distributed._torchrun",
               f"--nproc-per-node={args.num_processes}", f"--nnodes={args.num_machines}",
               f"--node-rank={args.machine_rank}", f"--master-addr={args.main_process_ip}",
               f"--master-port={args.main_process_port}"]
    if args.module:
        command.append("-m")
    return [*command, args.script, *args.script_args]


def _child_env(args: argparse.Namespace, extra: Mapping[str, str]) -> dict[str, str]:
    # A restarting launcher adds its own per attempt; inherited ones would make a first start a restart.
    env = {key: value for key, value in {**os.environ, **extra}.items() if key not in RESTART_VARIABLES}
    if args.timeout is not None:
        env[TIMEOUT_ENV_VAR] = f"{args.timeout:g}"
    if "OMP_NUM_THREADS" not in env and args.num_processes > 1:
        # torchrun would set 1 (and warn); share the cores instead: 16 cores, 4 ranks -> 4 threads each.
        env["OMP_NUM_THREADS"] = str(max(1, cpu_budget() // args.num_processes))
    return env


def _run(args: argparse.Namespace) -> int:
    written = None
    try:
        try:
            if not args.config_file:
                args.config_file = _default_config_file()
            written = _flags_to_config_file(args)
            extra = _apply_config_file(args) if args.config_file else {}
            if args.hostfile and not getattr(args, "on_host", False):  # on_host: one host's agent of that launch
                if getattr(args, "max_restarts", 0):
                    # Each host's launcher would restart its own ranks on its own: untested across hosts.
                    raise LaunchUsageError("--max-restarts is not supported with --hostfile yet: restart a hostfile "
                                           "job by relaunching it (Runner.resume(mode=True) / the Trainer's "
                                           "resume_from_checkpoint=True continue from the newest checkpoint)")
                return run_hostfile_launch(args, extra, flags_file=written)
            _resolve(args)
            check_restart_flags(args)
            env = _child_env(args, extra)
            collective = default_timeout(env)
        except (LaunchUsageError, ValueError, NotImplementedError) as err:
            # One line, whatever the error holds (several unknown keys, a YAML parser's multi-line message).
            print(f"shardkit launch: error: {'; '.join(str(err).splitlines())}", file=sys.stderr)
            return 2
        command = build_command(args)
        if args.dry_run:
            print(shlex.join(command))
            return 0
        # NOTE: imported here, not at the top: they import torch (5-8 s on a busy 2-core machine), which
        # `shardkit launch --help` and a usage error do not need.
        from shardkit.distributed.launcher import GRACE_PERIOD_S
        from shardkit.distributed.supervise import run_supervised

        if args.max_restarts:
            return run_with_restarts(command, env, max_restarts=args.max_restarts,
                                     straggle_s=collective + GRACE_PERIOD_S, stop_grace=args.stop_grace)
        return run_supervised(command, env, straggle_s=collective + GRACE_PERIOD_S, stop_grace=args.stop_grace)
    finally:
        if written is not None:
            written.unlink(missing_ok=True)
