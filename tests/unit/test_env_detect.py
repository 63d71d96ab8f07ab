"""Environment detection for torchrun, SLURM and a single process, and the collective timeout setting."""

from __future__ import annotations

import pytest

from shardkit.distributed import ClusterEnvironment, ClusterEnvironmentError, default_timeout, detect_environment
from shardkit.distributed.cluster import expand_nodelist

TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29555"}
SLURM = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
         "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "node[01-04,07]", "SLURM_JOB_ID": "4242123"}


def test_no_launcher_variables_means_a_single_process():
    assert detect_environment({}) == ClusterEnvironment(source="single")
    assert not detect_environment({}).is_distributed


def test_torchrun_variables():
    env = detect_environment(TORCHRUN)

    assert env == ClusterEnvironment(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                                     master_addr="10.1.2.3", master_port=29555, source="torchrun", rendezvous=True)
    assert env.is_distributed and not env.is_main_process


@pytest.mark.parametrize(("variables", "joins"), [
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}, True),  # torchrun, 1 process
    ({"RANK": "0", "WORLD_SIZE": "1"}, False),  # set by hand: no rendezvous named
    ({"RANK": "0", "WORLD_SIZE": "2"}, True),
    ({**SLURM, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
      "SLURM_NTASKS_PER_NODE": "1"}, False),  # srun -n 1: a private group where one is needed
    ({}, False),
])
def test_a_lone_process_joins_the_launchers_group_only_where_the_launcher_named_one(variables, joins):
    # NOTE: under torchrun any other rendezvous is a client of the agent's store (TORCHELASTIC_USE_AGENT_STORE),
    # which nobody serves for it: a lone worker must join the launcher's group or wait for ever.
    assert detect_environment(variables).joins_group is joins


def test_torchrun_wins_over_slurm_when_both_are_set():
    # torchrun started by srun: each worker has both sets; torchrun's describe the worker.
    assert detect_environment({**SLURM, **TORCHRUN}).source == "torchrun"


def test_hand_set_rank_and_world_size_assume_one_node():
    env = detect_environment({"RANK": "1", "WORLD_SIZE": "2"})

    assert (env.local_rank, env.local_world_size, env.node_rank) == (1, 2, 0)
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 29500)


def test_slurm_variables_with_a_compressed_nodelist():
    env = detect_environment(SLURM)

    assert env == ClusterEnvironment(rank=6, local_rank=2, world_size=8, local_world_size=4, node_rank=1,
                                     master_addr="node01", master_port=15000 + 2123, source="slurm")


def test_slurm_tasks_per_node_in_repeated_form_and_master_overrides():
    env = detect_environment({**{k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"},
                              "SLURM_NTASKS": "7", "SLURM_PROCID": "6", "SLURM_NODEID": "2", "SLURM_LOCALID": "0",
                              "SLURM_TASKS_PER_NODE": "3(x2),1", "MASTER_ADDR": "head", "MASTER_PORT": "1234"})

    assert (env.local_world_size, env.master_addr, env.master_port) == (1, "head", 1234)


def test_salloc_without_srun_stays_single():
    assert detect_environment({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}).source == "single"


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu7", ["gpu7"]),
    ("a1,b[9-10]", ["a1", "b9", "b10"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("node-[3],login1", ["node-3", "login1"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert expand_nodelist(nodelist, limit=1) == hosts[:1]


@pytest.mark.parametrize("nodelist", ["node[01-04", "node[4-1]", "node[a-b]", "node]1["])
def test_malformed_nodelist_names_the_variable(nodelist):
    with pytest.raises(ClusterEnvironmentError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(nodelist)


@pytest.mark.parametrize(("override", "needle"), [
    ({"RANK": "two"}, "RANK='two' is not an integer"),
    ({"LOCAL_RANK": "4"}, "local_rank(4) must be in [0, local_world_size(4))"),
    ({"RANK": "8"}, "rank(8) must be in [0, world_size(8))"),
    ({"MASTER_PORT": "70000"}, "master_port(70000)"),
])
def test_bad_torchrun_values_name_the_variable_and_value(override, needle):
    with pytest.raises(ClusterEnvironmentError) as info:
        detect_environment({**TORCHRUN, **override})
    assert needle in str(info.value)


@pytest.mark.parametrize(("override", "needle"), [
    ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc' is not an integer"),
    ({"SLURM_NTASKS_PER_NODE": "4x"}, "SLURM_NTASKS_PER_NODE='4x'"),
    ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set"),
])
def test_bad_slurm_values_name_the_variable_and_value(override, needle):
    with pytest.raises(ClusterEnvironmentError) as info:
        detect_environment({**SLURM, **override})
    assert needle in str(info.value)


def test_detect_reads_os_environ(monkeypatch):
    for key in (*TORCHRUN, *SLURM):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "cn[100-101]")
    monkeypatch.setenv("SLURM_JOB_ID", "77")

    env = detect_environment()
    assert (env.source, env.world_size, env.master_addr, env.master_port) == ("slurm", 2, "cn100", 15077)


def test_collective_timeout_setting(monkeypatch):
    monkeypatch.delenv("SHARDKIT_COLLECTIVE_TIMEOUT", raising=False)
    assert default_timeout() == 1800.0
    monkeypatch.setenv("SHARDKIT_COLLECTIVE_TIMEOUT", "20")
    assert default_timeout() == 20.0
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv("SHARDKIT_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"SHARDKIT_COLLECTIVE_TIMEOUT='{bad}'"):
            default_timeout()


def _two_node_task(procid: int, tasks_per_node: tuple[int, int], with_ntasks_per_node: bool) -> dict[str, str]:
    """The variables `srun` gives task `procid` of a 2-node allocation (`sbatch -N2`), as SLURM 23 sets them."""
    node = 0 if procid < tasks_per_node[0] else 1
    local = procid - (0 if node == 0 else tasks_per_node[0])
    same = tasks_per_node[0] == tasks_per_node[1]
    env = {"SLURM_JOB_ID": "918273", "SLURM_JOBID": "918273", "SLURM_JOB_NAME": "train",
           "SLURM_JOB_NODELIST": "gpu-[17-18]", "SLURM_NODELIST": "gpu-[17-18]", "SLURM_STEP_NODELIST": "gpu-[17-18]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_NTASKS": str(sum(tasks_per_node)), "SLURM_NPROCS": str(sum(tasks_per_node)),
           "SLURM_TASKS_PER_NODE": f"{tasks_per_node[0]}(x2)" if same else f"{tasks_per_node[0]},{tasks_per_node[1]}",
           "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node[0]}(x2)" if same else f"{tasks_per_node[0]},"
                                                                                f"{tasks_per_node[1]}",
           "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
           "SLURMD_NODENAME": f"gpu-{17 + node}", "SLURM_CPUS_ON_NODE": "32", "SLURM_SUBMIT_DIR": "/home/u"}
    if with_ntasks_per_node and same:
        env["SLURM_NTASKS_PER_NODE"] = str(tasks_per_node[0])
    return env


@pytest.mark.parametrize("with_ntasks_per_node", [True, False])
def test_every_task_of_a_two_node_slurm_allocation_finds_its_place(with_ntasks_per_node):
    envs = [detect_environment(_two_node_task(p, (2, 2), with_ntasks_per_node)) for p in range(4)]

    assert [(e.rank, e.node_rank, e.local_rank, e.local_world_size) for e in envs] == [
        (0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)]
    assert {(e.world_size, e.master_addr, e.master_port, e.source) for e in envs} == {
        (4, "gpu-17", 15000 + 8273, "slurm")}  # every task agrees on rank 0's host and the port


def test_uneven_two_node_slurm_allocation():
    envs = [detect_environment(_two_node_task(p, (3, 1), False)) for p in range(4)]

    assert [(e.node_rank, e.local_rank, e.local_world_size) for e in envs] == [
        (0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)]
