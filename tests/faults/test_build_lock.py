"""Killed builds: a baton left by a dead build never makes the next run wait; every wait and compile is bounded.

The probes' shapes (issue 30): a ZeRO run killed while an op builds leaves torch's ``lock`` baton in the op's
folder; a later run must clear it and go on, for DeepSpeed's ops as for shardkit's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardkit.ops.build_lock import BuildTimeout, build_lock, run_build_subprocess

_REPO = Path(__file__).resolve().parents[2]
CORPUS: list[str] = []


def _killed_build_baton(build_dir: Path) -> Path:
    """Leave torch's baton the way a killed build does: created by a process that then dies by SIGKILL."""
    build_dir.mkdir(parents=True, exist_ok=True)
    code = ("import os, signal, sys; from torch.utils.file_baton import FileBaton; "
            "assert FileBaton(os.path.join(sys.argv[1], 'lock')).try_acquire(); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(build_dir)], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert (build_dir / "lock").exists()
    return build_dir / "lock"


def test_stale_baton_of_a_killed_build_is_cleared(tmp_path):
    baton = _killed_build_baton(tmp_path / "op")
    with build_lock(tmp_path / "op", "a test op", wait_s=5):
        assert not baton.exists()
    CORPUS.append("killed build: stale baton cleared")


def test_waiting_for_a_live_build_is_bounded_and_names_the_holder(tmp_path):
    code = textwrap.dedent("""
        import sys, time
        from shardkit.ops.build_lock import build_lock
        with build_lock(sys.argv[1], "held"):
            print("held", flush=True)
            time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "op")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(BuildTimeout, match=rf"pid {holder.pid} building a test op.*SHARDKIT_BUILD_WAIT_S"):
            with build_lock(tmp_path / "op", "a test op", wait_s=1):
                pass
        assert time.monotonic() - start < 30
    finally:
        holder.kill()
        holder.wait()
    with build_lock(tmp_path / "op", "a test op", wait_s=5):  # the dead holder's lock went with it
        pass
    CORPUS.append("live build: wait bounded, holder named")


def test_a_hung_compile_is_stopped_with_a_message(tmp_path):
    (tmp_path / "op").mkdir()
    code = f"import time; open({str(tmp_path / 'op' / 'lock')!r}, 'x'); time.sleep(120)"  # a baton, then hangs
    with pytest.raises(BuildTimeout, match=r"did not finish in 2 s.*SHARDKIT_BUILD_TIMEOUT_S"):
        with build_lock(tmp_path / "op", "a hung op", wait_s=5):
            run_build_subprocess(code, "a hung op", tmp_path / "op", timeout_s=2)
    assert not (tmp_path / "op" / "lock").exists(), "the killed compile's baton must not stay behind"
    with pytest.raises(RuntimeError, match=r"(?s)building a broken op failed \(exit code 3.*no compiler here"):
        run_build_subprocess("import sys; print('no compiler here'); sys.exit(3)", "a broken op", tmp_path / "op")
    CORPUS.append("hung compile: stopped at its time limit, baton removed")
    CORPUS.append("failed compile: exit code and output named")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", ["zero_run", "build_ops_script"])
def test_deepspeed_op_with_a_killed_builds_baton_does_not_hang(entry):
    """The issue's reproduction: DeepSpeed's shm_comm folder holds a dead build's baton; the next ZeRO run loads, and
    so does `make test`'s scripts/build_ops.py (which once loaded DeepSpeed's ops directly and waited for ever)."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO / ".torch_extensions"))
    build_dir = Path(env["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    code = textwrap.dedent("""
        from shardkit.strategies.zero.strategy import build_deepspeed_op
        from deepspeed.accelerator import get_accelerator
        build_deepspeed_op("ShareMemCommBuilder")
        print("loaded", get_accelerator().create_op_builder("ShareMemCommBuilder").NAME)
    """)
    probe = subprocess.run([sys.executable, "-c", "from deepspeed.accelerator import get_accelerator; "
                            "print(get_accelerator().create_op_builder('ShareMemCommBuilder').NAME)"],
                           env=env, capture_output=True, text=True, timeout=120, check=True)
    build_dir = build_dir.parent / probe.stdout.strip().splitlines()[-1]
    _killed_build_baton(build_dir)
    command = ([sys.executable, "-c", code] if entry == "zero_run" else [sys.executable, "scripts/build_ops.py"])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280, cwd=_REPO)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert ("loaded" in done.stdout) if entry == "zero_run" else ("DeepSpeed shm_comm ...\n  ready in" in done.stdout)
    assert not (build_dir / "lock").exists()
    assert not (build_dir / "lock").exists()
    CORPUS.append("killed DeepSpeed build: next ZeRO run loads the op")


def test_print_corpus_counts():
    print(f"\nkilled-build corpus: {len(CORPUS)} probes passed: " + "; ".join(CORPUS))
