"""`shardkit launch --hostfile FILE`: one launch agent per host over OpenSSH, as DeepSpeed's runner.

    shardkit launch --hostfile hosts.txt --exclude "worker-1:3" train.py --lr 1e-3

Each selected host (see `shardkit.distributed.hostfile`) runs ``shardkit launch`` for its own machine rank
through ``ssh -o BatchMode=yes HOST``, in the directory this command runs in (a filesystem shared by the hosts, as
DeepSpeed assumes, with this Python at the same path), with the forwarded variables. Machine ranks follow the
hostfile's order; the rendezvous is the first host (``--master_addr`` names another address of it).

Every host's exit status is collected and printed. When one host fails, the others get a grace to report their own
errors (a peer's "Connection closed" says it was a consequence), then every host is stopped; SIGTERM/SIGINT here
stops them at once. Stopping a host closes its ssh session: its agent (`shardkit.distributed.ssh_agent`) sees its
standard input end and passes SIGTERM to its ranks, which get ``--stop-grace`` seconds before their process groups
are killed, so nothing is left running on a host whose session went away, however it went (this launcher killed,
the network down).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Mapping, Sequence

from shardkit.distributed.hostfile import (
    HostfileError,
    forwarded_environment,
    read_hostfile,
    remote_assignment,
    select_hosts,
)
from shardkit.distributed.signals import catch_stop_signals, redeliver
from shardkit.distributed.timeouts import check_timeout

__all__ = ["HostPlan", "add_hostfile_flags", "plan_hosts", "remote_command", "run_hostfile_launch", "ssh_command"]

DEFAULT_MASTER_PORT = 29500
# After the first host failed, the others get this long to fail on their own and print why before they are stopped.
FAILURE_GRACE_S = 3.0
# Beyond --stop-grace, how long a stopped host's agent gets to kill its ranks and report before its ssh is killed.
REPORT_MARGIN_S = 10.0
_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def add_hostfile_flags(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's multi-host flags on ``shardkit launch``."""
    group = parser.add_argument_group("several hosts over ssh (DeepSpeed's hostfile and flags)")
    group.add_argument("--hostfile", help="DeepSpeed's hostfile: 'HOST slots=N' per line; starts one launch agent "
                                          "per host over ssh (BatchMode: key or agent authentication)")
    group.add_argument("--include", help="hosts/slots to use, DeepSpeed's 'HOST[:SLOT,...]@HOST...'")
    group.add_argument("--exclude", help="hosts/slots not to use, the same syntax")
    group.add_argument("--num_nodes", "--num-nodes", dest="num_nodes", type=int,
                       help="use the first K hosts of the hostfile")
    group.add_argument("--master_addr", "--master-addr", dest="master_addr",
                       help="the address the hosts reach the first host at (default: its hostfile name)")
    group.add_argument("--ssh_port", "--ssh-port", dest="ssh_port", type=int, help="ssh's port on every host")
    group.add_argument("--ssh_args", "--ssh-args", dest="ssh_args", default="",
                       help="more arguments for ssh, one string (e.g. \"-F ./ssh_config -i key\")")


@dataclass(frozen=True)
class HostPlan:
    """One host's part: its machine rank and the slots (device indices) its ranks use."""

    host: str
    machine_rank: int
    slots: tuple[int, ...]


def plan_hosts(args: argparse.Namespace) -> list[HostPlan]:
    """The hosts of ``args.hostfile`` after the filters, checked against the machine/process counts given."""
    pool = read_hostfile(args.hostfile)
    filtered = bool(args.include or args.exclude)
    selected = select_hosts(pool, args.include, args.exclude, args.num_nodes,
                            None if filtered else args.num_processes)
    if filtered and args.num_processes is not None and {len(s) for s in selected.values()} != {args.num_processes}:
        raise HostfileError(f"--num-processes({args.num_processes}) per host disagrees with the filter, which keeps "
                            f"{ {host: len(s) for host, s in selected.items()} }; drop one of them")
    if args.num_machines is not None and args.num_machines != len(selected):
        raise HostfileError(f"--num-machines({args.num_machines}) disagrees with the {len(selected)} host(s) the "
                            f"hostfile {args.hostfile!r} selects; use --num_nodes to keep fewer hosts")
    if args.machine_rank not in (None, 0):
        raise HostfileError("--machine-rank is set per host by --hostfile (the hostfile's order); drop it")
    return [HostPlan(host, rank, tuple(slots)) for rank, (host, slots) in enumerate(selected.items())]


def _master(args: argparse.Namespace, plans: Sequence[HostPlan]) -> tuple[str, int]:
    if args.master_addr and args.main_process_ip and args.master_addr != args.main_process_ip:
        raise HostfileError(f"--master_addr({args.master_addr}) and --main-process-ip({args.main_process_ip}) differ; "
                            "give one")
    # ssh's "user@" is no part of the address the ranks connect to
    address = args.master_addr or args.main_process_ip or plans[0].host.rpartition("@")[2]
    port = DEFAULT_MASTER_PORT if args.main_process_port is None else args.main_process_port
    if not 0 < port < 65536:
        raise HostfileError(f"--main-process-port({port}) must be in [1, 65535]")
    return address, port


def remote_command(plan: HostPlan, plans: Sequence[HostPlan], args: argparse.Namespace, env: Mapping[str, str],
                   cwd: str, python: str = sys.executable) -> str:
    """The shell line one host runs: its agent, in ``cwd``, with ``env`` and its machine rank."""
    address, port = _master(args, plans)
    variables = dict(env)
    if list(plan.slots) != list(range(len(plan.slots))):
        chosen = variables.get("CUDA_VISIBLE_DEVICES")
        if chosen:  # the config's gpu_ids ("" is its use_cpu, where slots pick no device)
            raise HostfileError(f"the filter keeps slots {list(plan.slots)} of {plan.host}, but the config already "
                                f"sets CUDA_VISIBLE_DEVICES={chosen} (gpu_ids); keep one of the two")
        if chosen is None:
            variables["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan.slots))
    agent = [python, "-u", "-m", "shardkit.distributed.ssh_agent", "--num-processes", str(len(plan.slots)),
             "--num-machines", str(len(plans)), "--machine-rank", str(plan.machine_rank),
             "--main-process-ip", address, "--main-process-port", str(port), "--stop-grace", f"{args.stop_grace:g}"]
    if args.timeout is not None:
        agent += ["--timeout", f"{args.timeout:g}"]
    if args.config_file:
        agent += ["--config-file", str(Path(args.config_file).resolve())]
    if args.module:
        agent.append("-m")
    agent += [args.script, *args.script_args]
    assignments = [remote_assignment(key, value) for key, value in variables.items()]
    return f"cd {shlex.quote(cwd)} && exec env {' '.join(assignments)} {shlex.join(agent)}"


def ssh_command(host: str, remote: str, args: argparse.Namespace) -> list[str]:
    """``ssh`` for one host: never prompting (BatchMode), its remote line as one argument."""
    command = ["ssh", "-o", "BatchMode=yes"]
    if args.ssh_port is not None:
        command += ["-p", str(args.ssh_port)]
    try:
        command += shlex.split(args.ssh_args or "")
    except ValueError as err:
        raise HostfileError(f"--ssh_args {args.ssh_args!r}: {err}") from None
    return [*command, "--", host, remote]


@dataclass
class _Host:
    plan: HostPlan
    process: subprocess.Popen
    pump: threading.Thread
    code: int | None = None
    ended_at: float | None = None
    stopped: bool = False
    notes: list[str] = field(default_factory=list)


def _pump(host: str, source: IO[bytes], sink: IO[bytes]) -> None:
    """Copy a host's output line by line, each prefixed with the host (as pdsh does)."""
    prefix = f"{host}: ".encode()
    for line in iter(source.readline, b""):
        sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
        sink.flush()
    source.close()


def _end_with_parent() -> None:
    """In the forked ssh client: SIGTERM when the launcher's thread that started it dies (Linux's parent-death
    signal; elsewhere nothing, and a killed launcher leaves its ssh sessions to end on their own)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def run_hostfile_launch(args: argparse.Namespace, extra: Mapping[str, str], flags_file: Path | None = None) -> int:
    """Launch ``args.script`` on every host of ``args.hostfile``; the exit code to return (0: every host succeeded).

    Raises:
        HostfileError / ValueError: a bad hostfile, filter, env file or flag combination (nothing started).
    """
    if flags_file is not None:
        raise HostfileError("--hostfile with accelerate's config-as-flags: the other hosts cannot read the file those "
                            "flags are written to here; put the settings in a --config_file on a filesystem every host "
                            "shares")
    plans = plan_hosts(args)
    _master(args, plans)
    if args.timeout is not None:
        args.timeout = check_timeout(args.timeout, f"--timeout({args.timeout})")
    args.stop_grace = check_timeout(args.stop_grace, f"--stop-grace({args.stop_grace})")
    if not args.module and not Path(args.script).is_file():
        raise HostfileError(f"script {args.script!r} not found (use -m for a module name)")
    cwd = os.getcwd()
    env = {**forwarded_environment(os.environ, cwd), **extra}
    commands = [ssh_command(plan.host, remote_command(plan, plans, args, env, cwd), args) for plan in plans]
    if args.dry_run:
        for command in commands:
            print(shlex.join(command))
        return 0
    print(f"shardkit launch: {len(plans)} host(s) over ssh: " + ", ".join(
        f"{p.host} (machine {p.machine_rank}, {len(p.slots)} process(es))" for p in plans), file=sys.stderr, flush=True)
    hosts: list[_Host] = []
    with catch_stop_signals() as received:
        try:
            for plan, command in zip(plans, commands):
                # Own session: a Ctrl-C at the terminal reaches this launcher alone, which stops the hosts in order.
                # Ended with this launcher however it dies (SIGKILL too), so that no session outlives it.
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=_end_with_parent)
                hosts.append(_Host(plan, process, threading.Thread(
                    target=_pump, args=(plan.host, process.stdout, sys.stdout.buffer), daemon=True)))
            for host in hosts:  # after every fork: preexec_fn is unsafe while other threads run
                host.pump.start()
            _watch(hosts, args.stop_grace, received)
        finally:
            for host in hosts:
                if host.process.poll() is None:
                    host.process.kill()
                host.process.wait()
                if host.pump.ident is not None:  # started
                    host.pump.join(timeout=5)
    code = _summarise(hosts)
    if received:
        redeliver(received[0])
    return code


def _stop(hosts: Sequence[_Host]) -> None:
    """End every running host's session input: its agent passes SIGTERM to its ranks (see the module docstring)."""
    for host in hosts:
        if host.process.poll() is None and not host.stopped:
            host.stopped = True
            try:
                host.process.stdin.close()
            except OSError:
                pass


def _watch(hosts: list[_Host], stop_grace: float, received: list[int]) -> None:
    first_failure: _Host | None = None
    stop_at = kill_at = None
    while any(host.code is None for host in hosts):
        now = time.monotonic()
        for host in hosts:
            if host.code is None and host.process.poll() is not None:
                host.code, host.ended_at = host.process.returncode, now
                if host.code != 0 and first_failure is None and not host.stopped:
                    first_failure = host
                    print(f"shardkit launch: host {host.plan.host} (machine {host.plan.machine_rank}) failed "
                          f"({_how(host.code)}); stopping the other hosts", file=sys.stderr, flush=True)
                    stop_at = now + FAILURE_GRACE_S
        if received and kill_at is None:
            print(f"shardkit launch: got {signal.Signals(received[0]).name}; stopping every host (its ranks have "
                  f"{stop_grace:g} s to save)", file=sys.stderr, flush=True)
            stop_at = now
        if stop_at is not None and now >= stop_at and kill_at is None:
            _stop(hosts)
            kill_at = now + stop_grace + REPORT_MARGIN_S
        if kill_at is not None and now >= kill_at:
            for host in hosts:
                if host.process.poll() is None:
                    host.notes.append("its ssh was killed: the host did not report in time")
                    host.process.kill()
        time.sleep(_POLL_S)


def _how(code: int) -> str:
    if code < 0:
        return f"its ssh was killed by {signal.Signals(-code).name}"
    if code == 255:
        return "ssh exit 255: it could not connect or log in, or the remote side died of a signal"
    return f"exit code {code}"


def _summarise(hosts: Sequence[_Host]) -> int:
    failed = [host for host in hosts if host.code != 0]
    if not failed:
        return 0
    first = min(failed, key=lambda host: (host.stopped, host.ended_at or float("inf")))
    lines = [f"shardkit launch: the job failed on {len(failed)} of {len(hosts)} host(s)"]
    for host in hosts:
        code = host.code if host.code is not None else -signal.SIGKILL
        role = "failed first" if host is first else ("stopped by the launcher" if host.stopped else "")
        notes = "; ".join(filter(None, [role, *host.notes]))
        how = "ok" if code == 0 else ("ended by the stop" if host.stopped and code == 255 else _how(code))
        notes = f" ({notes})" if notes else ""
        lines.append(f"  host {host.plan.host} (machine {host.plan.machine_rank}): {how}{notes}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    code = first.code if first.code is not None else 1
    return 128 - code if code < 0 else code
