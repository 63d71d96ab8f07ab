"""Issue 27: `shardkit launch` names a rank killed by SIGKILL / the OOM killer, with the memory it had and the
`shardkit estimate-memory` command for the run."""

from __future__ import annotations

import sys
import textwrap

from shardkit.distributed import oom
from shardkit.distributed.supervise import run_supervised

# Stands in for torchrun: starts "rank 1" in its own session; the rank fills 200 MiB, leaves the run's size as
# rank 0's Runner does at setup (oom.write_run_facts; not imported, to keep the rank small) and is SIGKILLed, as
# the OOM killer does. Unlike torchrun (which reaps within 0.1 s) this parent reaps it a second late, so the
# supervisor sees the zombie's exit status; then it fails as torchrun does.
_FAKE_TORCHRUN = textwrap.dedent("""
    import os, subprocess, sys, time
    code = (
        "import os, signal, time\\n"
        "from shardkit.distributed.oom import write_run_facts\\n"
        "held = b'x' * (200 << 20)\\n"
        "write_run_facts(os.environ['SHARDKIT_REPORT_DIR'], 124_000_000, 'bf16', 2, 1)\\n"
        "time.sleep(1.0)\\n"
        "os.kill(os.getpid(), signal.SIGKILL)\\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": "1"}, start_new_session=True)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie
    time.sleep(1.0)
    child.wait()
    sys.exit(1)
""")


def test_launch_names_the_killed_rank_its_memory_and_the_estimate_command(capsys):
    code = run_supervised([sys.executable, "-c", _FAKE_TORCHRUN], dict(__import__("os").environ), straggle_s=60,
                          stop_grace=5)
    err = capsys.readouterr().err
    assert code == 1
    assert "rank 1 was killed by SIGKILL (exit -9, 137 in a shell)" in err
    rss = float(err.split("killed by SIGKILL (exit -9, 137 in a shell), ")[1].split(" GiB")[0])
    assert 0.19 < rss < 1.0  # the 200 MiB it held (and the interpreter)
    assert "out-of-memory killer" in err
    assert "shardkit estimate-memory --params 124000000 --num-gpus 2 --num-nodes 1 --precision bf16" in err


def test_oom_counter_names_the_cause_and_hostile_facts_are_refused(tmp_path):
    text = oom.describe_kill(0, None, 3 * 2**30, oom_kills=1, facts=None)
    assert "rank 0 vanished without an error, 3.00 GiB resident" in text
    assert "out-of-memory killer ended it (1 OOM kill(s)" in text and "--params <model parameters>" in text
    assert oom.describe_kill(0, None, None, oom_kills=0, facts=None) == ""
    (tmp_path / oom.RUN_FACTS).write_text('{"params": 5, "precision": "bf16; rm -rf /", "nproc_per_node": 1, '
                                          '"nodes": 1}')
    assert oom.read_run_facts(tmp_path) is None
    (tmp_path / oom.RUN_FACTS).write_text('{"params": -5, "precision": "bf16", "nproc_per_node": 1, "nodes": 1}')
    assert oom.read_run_facts(tmp_path) is None
    oom.write_run_facts(tmp_path, 7, "fp32", 1, 1)
    assert oom.read_run_facts(tmp_path) == {"params": 7, "precision": "fp32", "nproc_per_node": 1, "nodes": 1}


def test_exit_signals_and_facts_files_are_read_as_hostile_input(tmp_path):
    import os

    oom.write_exit_signals(tmp_path, {1: 9, 0: 15})
    assert oom.read_exit_signals(tmp_path) == {1: 9, 0: 15}
    cases = {"digit_not_ascii": '{"\u00b2": 9}', "signal_range": '{"1": 999}', "signal_type": '{"1": "9"}',
             "nested": "[" * 2000, "not_json": "\x00\xff", "list": "[1, 2]"}
    for text in cases.values():
        (tmp_path / oom.EXIT_SIGNALS).write_text(text)
        assert oom.read_exit_signals(tmp_path) == {}
    (tmp_path / oom.EXIT_SIGNALS).write_text('{"1": 9}' + " " * 5000)  # over the size bound
    assert oom.read_exit_signals(tmp_path) == {}
    (tmp_path / oom.RUN_FACTS).write_text("[" * 2000)
    assert oom.read_run_facts(tmp_path) is None
    for name in (oom.EXIT_SIGNALS, oom.RUN_FACTS):  # a FIFO would block a plain open; a link points elsewhere
        (tmp_path / name).unlink()
        os.mkfifo(tmp_path / name)
        assert oom.read_exit_signals(tmp_path) == {} and oom.read_run_facts(tmp_path) is None
        (tmp_path / name).unlink()
    (tmp_path / "elsewhere.json").write_text('{"1": 9}')
    (tmp_path / oom.EXIT_SIGNALS).symlink_to(tmp_path / "elsewhere.json")
    assert oom.read_exit_signals(tmp_path) == {}
