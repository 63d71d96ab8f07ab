"""DeepSpeed's hostfile, filters and env file as `shardkit launch --hostfile` reads them, the ssh command lines it
builds, and Accelerate's deepspeed_hostfile / deepspeed_multinode_launcher keys mapped onto it (in process: the real
launch over a loopback sshd is tests/distributed/test_ssh_launch.py)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from shardkit.config.accelerate import launch_args_from_yaml
from shardkit.distributed.cli import LaunchUsageError
from shardkit.distributed.hostfile import (
    HostfileError,
    forwarded_environment,
    parse_filter,
    parse_hostfile,
    read_env_file,
    remote_assignment,
    select_hosts,
)
from shardkit.distributed.ssh_launch import plan_hosts, remote_command, ssh_command

HOSTFILE = """
# two GPU machines and a small one
worker-0 slots=4
worker-1 slots=4   # trailing comment

worker-2 slots=2
"""


def test_hostfile_keeps_order_and_skips_comments_and_blank_lines():
    assert parse_hostfile(HOSTFILE) == {"worker-0": 4, "worker-1": 4, "worker-2": 2}
    assert parse_hostfile("me@10.0.0.1 slots=1\nfe80::1 slots=2") == {"me@10.0.0.1": 1, "fe80::1": 2}


@pytest.mark.parametrize("text, fragment", [
    ("worker-0 slots=4\nworker-0 slots=2", "line 2: host 'worker-0' is already named"),
    ("worker-0 slots=4\nworker-1 4", "line 2: 'worker-1 4' is not 'HOST slots=N'"),
    ("worker-0 slots=four", "slots=four must be a whole number"),
    ("worker-0 slots=0", r"slots=0 must be a whole number in \[1, 65536\]"),
    ("worker-0 slots=80000000000", "slots=80000000000 must be a whole number in"),  # a typo: refused, not listed
    ("worker-0 slots=2 gpus=2", "is not 'HOST slots=N'"),
    ("-oProxyCommand=x slots=2", "is not a host name"),
    ("a;b slots=2", "is not a host name"),
    ("# only a comment\n\n", "names no host"),
])
def test_bad_hostfiles_are_refused_by_line(text, fragment):
    with pytest.raises(HostfileError, match=fragment.replace("(", r"\(")):
        parse_hostfile(text)


def test_filters_follow_deepspeeds_syntax():
    pool = parse_hostfile(HOSTFILE)
    assert parse_filter("worker-0@worker-1:0,2", "--include") == {"worker-0": None, "worker-1": [0, 2]}
    assert select_hosts(pool, include="worker-2@worker-1:0,2") == {"worker-1": [0, 2], "worker-2": [0, 1]}
    assert select_hosts(pool, exclude="worker-0@worker-1:3") == {"worker-1": [0, 1, 2], "worker-2": [0, 1]}
    assert select_hosts(pool, num_nodes=2, slots_per_host=2) == {"worker-0": [0, 1], "worker-1": [0, 1]}


@pytest.mark.parametrize("kwargs, fragment", [
    ({"include": "worker-9"}, "host 'worker-9' is not in the hostfile"),
    ({"include": "worker-2:5"}, r"\[5\] do not exist"),
    ({"include": "worker-2:x"}, "slot 'x' of 'worker-2' is not a whole number"),
    ({"include": "worker-0", "exclude": "worker-1"}, "cannot be used together"),
    ({"include": "worker-0", "num_nodes": 1}, "--num_nodes cannot be used with"),
    ({"exclude": "worker-0@worker-1@worker-2"}, "leaves no host"),
    ({"num_nodes": 4}, r"--num_nodes\(4\) must be in \[1, 3\]"),
    ({"slots_per_host": 3}, r"\['worker-2'\] have fewer"),
])
def test_bad_filters_are_refused_by_name(kwargs, fragment):
    with pytest.raises(HostfileError, match=fragment):
        select_hosts(parse_hostfile(HOSTFILE), **kwargs)


def test_forwarded_environment_takes_deepspeeds_prefixes_and_env_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "job"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth0\nFROM_HOME=1\n")
    (cwd / ".deepspeed_env").write_text("# the job's own\n\nFROM_HOME = 2\nWITH_SPACES=a b=c\n")
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/opt/lib", "SHARDKIT_COLLECTIVE_TIMEOUT": "30", "HOME": "/x",
               "UCX_TLS": "rc", "SECRET_TOKEN": "no", "LD_LIBRARY_PATH": "/no"}
    env = forwarded_environment(environ, cwd, home=home)
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "PYTHONPATH": f"{cwd}:/opt/lib",
                   "SHARDKIT_COLLECTIVE_TIMEOUT": "30", "UCX_TLS": "rc", "FROM_HOME": "2", "WITH_SPACES": "a b=c"}
    (cwd / "other_env").write_text("A=1\n")
    assert forwarded_environment({"DS_ENV_FILE": "other_env"}, cwd, home=home)["A"] == "1"


def test_bad_env_file_lines_are_refused_by_line(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_text("GOOD=1\nexport BAD=2\n")
    with pytest.raises(HostfileError, match=r"line 2: 'export BAD=2' is not KEY=VALUE"):
        read_env_file(path)
    path.write_text("NOEQUALS\n")
    with pytest.raises(HostfileError, match="line 1"):
        forwarded_environment({}, tmp_path, home=tmp_path / "nowhere")


def _args(hostfile, **overrides):
    values = dict(hostfile=str(hostfile), include=None, exclude=None, num_nodes=None, num_processes=None,
                  num_machines=None, machine_rank=None, master_addr=None, main_process_ip=None,
                  main_process_port=None, timeout=None, stop_grace=25.0, config_file=None, module=False,
                  script="train.py", script_args=["--lr", "1e-3", "a b"], ssh_port=2222, ssh_args="-F 'my cfg'")
    values.update(overrides)
    return argparse.Namespace(**values)


def test_each_host_gets_its_machine_rank_devices_and_the_variables(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTFILE)
    args = _args(hostfile, include="worker-0@worker-1:1,3")
    plans = plan_hosts(args)
    assert [(p.host, p.machine_rank, p.slots) for p in plans] == [("worker-0", 0, (0, 1, 2, 3)),
                                                                   ("worker-1", 1, (1, 3))]
    line = remote_command(plans[1], plans, args, {"NCCL_DEBUG": "INFO", "Q": "it's"}, "/shared/job",
                          python="/venv/bin/python")
    words = shlex.split(line)
    assert words[:3] == ["cd", "/shared/job", "&&"]
    assert {"NCCL_DEBUG=INFO", "Q=it's", "CUDA_VISIBLE_DEVICES=1,3"} <= set(words)
    agent = words[words.index("/venv/bin/python"):]
    assert agent[agent.index("--num-processes") + 1] == "2" and agent[agent.index("--machine-rank") + 1] == "1"
    assert agent[agent.index("--main-process-ip") + 1] == "worker-0"  # the first host is the rendezvous
    assert agent[agent.index("--main-process-port") + 1] == "29500"
    assert agent[-4:] == ["train.py", "--lr", "1e-3", "a b"]  # the script's arguments as given
    assert "CUDA_VISIBLE_DEVICES" not in remote_command(plans[0], plans, args, {}, "/shared/job")
    assert "CUDA_VISIBLE_DEVICES= " in remote_command(plans[1], plans, args, {"CUDA_VISIBLE_DEVICES": ""}, "/j")
    with pytest.raises(HostfileError, match=r"keeps slots \[1, 3\] of worker-1, but the config already sets"):
        remote_command(plans[1], plans, args, {"CUDA_VISIBLE_DEVICES": "0,1"}, "/job")  # gpu_ids: 0,1
    hostfile.write_text("me@node-a slots=1\nnode-b slots=1\n")
    plans = plan_hosts(_args(hostfile))
    assert "--main-process-ip node-a " in remote_command(plans[1], plans, _args(hostfile), {}, "/job")
    assert ssh_command("worker-1", line, args) == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-F", "my cfg", "--",
                                                   "worker-1", line]


@pytest.mark.parametrize("overrides, fragment", [
    ({"num_machines": 2}, r"--num-machines\(2\) disagrees with the 3 host"),
    ({"machine_rank": 1}, "--machine-rank is set per host"),
    ({"include": "worker-0:0", "num_processes": 2}, r"--num-processes\(2\) per host disagrees with the filter"),
])
def test_inconsistent_flags_are_refused(tmp_path, overrides, fragment):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTFILE)
    with pytest.raises(HostfileError, match=fragment):
        plan_hosts(_args(hostfile, **overrides))


def _yaml(tmp_path, **section):
    path = tmp_path / "ds.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "num_processes": 4, "num_machines": 2,
                                    "main_process_ip": "10.0.0.1", "use_cpu": True,
                                    "deepspeed_config": {"zero_stage": 2, **section}}))
    return path


def test_accelerate_multinode_keys_map_onto_the_hostfile_launch(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.chdir(tmp_path)
    args = launch_args_from_yaml(_yaml(tmp_path, deepspeed_multinode_launcher="pdsh", deepspeed_hostfile="hosts",
                                       deepspeed_exclusion_filter="worker-1:3"))
    assert (args["hostfile"], args.get("include"), args["exclude"]) == (str(tmp_path / "hosts"), None, "worker-1:3")
    assert (args["num_processes"], args["num_machines"]) == (2, 2)
    # accelerate launch's default launcher is pdsh once a hostfile is named
    assert launch_args_from_yaml(_yaml(tmp_path, deepspeed_hostfile="hosts"))["hostfile"] == str(tmp_path / "hosts")
    assert "hostfile" not in launch_args_from_yaml(_yaml(tmp_path, deepspeed_multinode_launcher="standard",
                                                         deepspeed_hostfile="hosts"))
    with pytest.raises(LaunchUsageError, match="deepspeed_exclusion_filter in .*: give one"):  # never one dropped
        launch_args_from_yaml(_yaml(tmp_path, deepspeed_hostfile="hosts", deepspeed_inclusion_filter="worker-0",
                                    deepspeed_exclusion_filter="worker-1"))
    with pytest.raises(LaunchUsageError, match="needs deepspeed_config.deepspeed_hostfile"):
        launch_args_from_yaml(_yaml(tmp_path, deepspeed_multinode_launcher="pdsh"))
    with pytest.raises(LaunchUsageError, match="openmpi .*under SLURM use srun"):
        launch_args_from_yaml(_yaml(tmp_path, deepspeed_multinode_launcher="openmpi", deepspeed_hostfile="h"))
    with pytest.raises(LaunchUsageError, match="did you mean 'pdsh'"):
        launch_args_from_yaml(_yaml(tmp_path, deepspeed_multinode_launcher="pdssh", deepspeed_hostfile="h"))


def test_dry_run_prints_one_ssh_line_per_host(tmp_path):
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    (tmp_path / "train.py").write_text("")
    result = subprocess.run([sys.executable, "-m", "shardkit.cli", "launch", "--hostfile", "hosts", "--dry-run",
                             "train.py", "--x", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [shlex.split(line)[4] for line in lines] == ["127.0.0.1", "127.0.0.2"]
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\nbroken line\n")
    result = subprocess.run([sys.executable, "-m", "shardkit.cli", "launch", "--hostfile", "hosts", "train.py"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "line 2: 'broken line' is not 'HOST slots=N'" in result.stderr
    # restarts across hosts are not built: refused by name rather than a hostfile job that never restarts
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    result = subprocess.run([sys.executable, "-m", "shardkit.cli", "launch", "--hostfile", "hosts", "--max-restarts",
                             "2", "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--max-restarts is not supported with --hostfile" in result.stderr


def test_env_file_values_expand_remote_variables_and_run_nothing(tmp_path):
    """DeepSpeed's runner lets the remote shell expand an env file's values: `$LD_LIBRARY_PATH` must be the remote
    host's, not the literal text; a command substitution must never run (refused by line)."""
    path = tmp_path / ".deepspeed_env"
    path.write_text("LD_LIBRARY_PATH=/opt/nccl lib:$LD_LIBRARY_PATH\nPYTHONPATH=${EXTRA}/x\nPRICE=5\\$ 'q'\n")
    env = forwarded_environment({}, tmp_path, home=tmp_path / "nowhere")
    words = " ".join(remote_assignment(key, value) for key, value in env.items())
    shown = subprocess.run(["sh", "-c", f"exec env {words} {shlex.quote(sys.executable)} -c "
                                        "'import os; print(repr([os.environ[k] for k in "
                                        "(\"LD_LIBRARY_PATH\", \"PYTHONPATH\", \"PRICE\")]))'"],
                           env={"LD_LIBRARY_PATH": "/remote/lib", "EXTRA": "/e e"}, capture_output=True, text=True)
    assert shown.stdout.strip() == repr(["/opt/nccl lib:/remote/lib", f"{tmp_path.resolve()}:/e e/x", "5$ 'q'"])
    for bad, shown_as in (("A=$(touch pwned)", "'$'"), ("A=`id`", "'`'"), ("A=$1", "'$'")):
        path.write_text(f"OK=1\n{bad}\n")
        with pytest.raises(HostfileError, match=f"line 2: A's value: {re.escape(shown_as)} at character"):
            read_env_file(path)
    assert not (tmp_path / "pwned").exists()
