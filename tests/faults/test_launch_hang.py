"""Issue 13 K, L, P, G: hung ranks are named and every job ends, under `shardkit.launch()`.

Collective timeouts here are a few seconds so that each case ends in well under a minute.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from shardkit.distributed import LaunchError, LaunchTimeout, default_timeout, init_distributed, launch

SHORT = {"SHARDKIT_COLLECTIVE_TIMEOUT": "4"}


def _rank1_sleeps_before_all_reduce() -> None:
    env = init_distributed("cpu")
    dist.barrier()
    if env.rank == 1:
        time.sleep(300)  # alive, sockets open, never joins the collective
    dist.all_reduce(torch.ones(1))


def _rank1_hangs_after_last_collective() -> int:
    env = init_distributed("cpu")
    dist.all_reduce(torch.ones(1))
    if env.rank == 1:
        time.sleep(300)
    return env.rank  # rank 0 returns; launch() destroys the group (its final barrier times out)


def _rank1_hangs_without_a_group() -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(300)
    return rank  # no process group: nothing times out inside the ranks, only the launcher's rule ends it


def _ranks_of_a_three_rank_job_where_rank2_hangs() -> None:
    env = init_distributed("cpu")
    dist.barrier()
    if env.rank == 2:
        time.sleep(300)
    dist.all_reduce(torch.ones(1))


def test_the_hung_rank_is_named_as_root_cause_on_every_rank_and_in_the_summary():
    with pytest.raises(LaunchError) as info:
        launch(_rank1_sleeps_before_all_reduce, num_processes=2, timeout=120, env=SHORT)
    err = info.value

    assert not isinstance(err, LaunchTimeout)
    assert err.hung_ranks == [1] and err.failed_ranks[0] == 1
    first_line = str(err).splitlines()[0]
    assert first_line.startswith("rank 1 did not arrive at a collective: rank(s) [0] timed out waiting for it")
    assert "waiting for rank 1, which did not arrive" in err.tracebacks[0]  # rank 0's own message
    assert err.exitcodes[1] == -signal.SIGTERM


def test_three_ranks_both_waiting_ranks_name_the_same_sleeper():
    with pytest.raises(LaunchError) as info:
        launch(_ranks_of_a_three_rank_job_where_rank2_hangs, num_processes=3, timeout=120, env=SHORT)
    err = info.value

    assert err.hung_ranks == [2] and err.failed_ranks[0] == 2
    reporters = [r for r, tb in err.tracebacks.items() if "waiting for rank 2, which did not arrive" in tb]
    assert reporters and 2 not in reporters


def test_a_rank_hanging_after_its_last_collective_fails_the_job_naming_it():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank1_hangs_after_last_collective, num_processes=2, env=SHORT)  # no job timeout at all
    err = info.value

    assert time.monotonic() - start < 120  # sleeps 300 s: the job was ended, not waited for
    assert err.hung_ranks == [1] and err.exitcodes[0] != 0
    assert "the final barrier (destroy_distributed) timed out after 4 s waiting for rank 1" in err.tracebacks[0]


def test_a_rank_outliving_the_others_is_stopped_after_the_collective_timeout_and_a_grace():
    with pytest.raises(LaunchError) as info:
        launch(_rank1_hangs_without_a_group, num_processes=2, env=SHORT)
    err = info.value

    assert err.hung_ranks == [1] and err.failed_ranks == [1]
    assert "rank 1 was still running after rank(s) [0] had returned" in str(err)
    assert err.exitcodes == {0: 0, 1: -signal.SIGTERM}


@pytest.mark.parametrize("bad", ["inf", "nan", "-1", "0", "1e400", "soon"])
def test_collective_timeout_must_be_a_positive_finite_number(bad, monkeypatch):
    monkeypatch.setenv("SHARDKIT_COLLECTIVE_TIMEOUT", bad)
    with pytest.raises(ValueError, match=f"SHARDKIT_COLLECTIVE_TIMEOUT='{bad}'"):
        default_timeout()
    monkeypatch.delenv("SHARDKIT_COLLECTIVE_TIMEOUT")
    with pytest.raises(ValueError, match="SHARDKIT_COLLECTIVE_TIMEOUT"):  # refused before any rank starts
        launch(_rank1_hangs_without_a_group, num_processes=2, env={"SHARDKIT_COLLECTIVE_TIMEOUT": bad})
    with pytest.raises(ValueError, match=r"timeout\("):
        init_distributed("cpu", timeout=float(bad) if bad != "soon" else bad)


def _ddp_one_process() -> tuple[str, list[float]]:
    from shardkit import Runner

    torch.manual_seed(0)
    runner = Runner()  # reads SHARDKIT_CONFIG_FILE: MULTI_CPU with num_processes 1 asks for DDP
    model = torch.nn.Linear(4, 1)
    model, optimizer = runner.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        runner.backward(loss)
        runner.step()
        losses.append(loss.item())
    runner.teardown()
    return type(runner.strategy).__name__, losses


def test_ddp_at_world_size_one_from_an_accelerate_yaml_trains(tmp_path):
    config = tmp_path / "multi_cpu_1.yaml"
    config.write_text("distributed_type: MULTI_CPU\nnum_processes: 1\nmixed_precision: 'no'\n")

    [(strategy, losses)] = launch(_ddp_one_process, num_processes=1, in_process=False, timeout=120,
                                  env={"SHARDKIT_CONFIG_FILE": str(config)})

    assert strategy == "DDP" and losses[-1] < losses[0]


@pytest.mark.parametrize("bad", ["inf", "nan", "-1", "1e400"])
def test_cli_refuses_a_non_finite_timeout_in_one_line(bad, tmp_path, capsys, monkeypatch):
    from shardkit import cli

    script = tmp_path / "train.py"
    script.write_text("")

    assert cli.main(["launch", "--timeout", bad, "--dry-run", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardkit launch: error: --timeout(") and len(err.strip().splitlines()) == 1

    monkeypatch.setenv("SHARDKIT_COLLECTIVE_TIMEOUT", bad)  # inherited by every rank: refused before starting
    assert cli.main(["launch", "--dry-run", str(script)]) == 2
    assert f"SHARDKIT_COLLECTIVE_TIMEOUT='{bad}'" in capsys.readouterr().err


def test_timeout_recognition_and_launcher_reports_are_strict(tmp_path):
    from shardkit.distributed import watchdog

    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation")
    nccl = RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)")
    assert watchdog.is_collective_timeout(gloo) and watchdog.is_collective_timeout(nccl)
    assert not watchdog.is_collective_timeout(RuntimeError("request timeout from the data server"))
    assert not watchdog.is_collective_timeout(TimeoutError("Timed out waiting 5ms"))  # not a collective's
    assert watchdog.explain(gloo) is None  # no process group here: nothing to ask

    (tmp_path / "rank-0.json").write_text('{"rank": 0, "missing": [1], "message": "m0"}')
    (tmp_path / "rank-2.json").write_text('{"rank": 2, "missing": "all", "message": "m2"}')  # hostile: skipped
    (tmp_path / "rank-3.json").write_bytes(b"\xff\xfe")
    assert watchdog.read_reports(tmp_path) == [watchdog.TimeoutReport(0, [1], "m0")]
