"""Killed builds: a baton left by a dead build never makes the next run wait; every wait and compile is bounded.

The probes' shapes (issue 30): a ZeRO run killed while an op builds leaves torch's ``lock`` baton in the op's
folder; a later run must clear it and go on, for DeepSpeed's ops as for shardkit's own.
"""

from __future__ import annotations

import contextlib
import os
import re
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


# A compiler in front of c++ that logs each compile and link, says when one starts while another logged one still
# runs (two builds in one folder), and can be slowed down (or leave a half-written library) so a job is killed mid-way.
_CXX_WRAPPER = """#!{python}
import os, sys, time

def alive(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

step = "link" if "-shared" in sys.argv else "compile" if "-c" in sys.argv else None
if step:
    log = os.environ["TINY_CXX_LOG"]
    earlier = [int(line.split()[1]) for line in open(log)] if os.path.exists(log) else []
    busy = [pid for pid in earlier if alive(pid)]
    with open(log, "a") as out:
        out.write(f"{{step}} {{os.getpid()}}" + (f" CONCURRENT with {{busy}}" if busy else "") + "\\n")
    if os.environ.get("TINY_CXX_SLOW") == step:
        if step == "link":  # a half-written library, as a link killed half-way leaves it
            with open(sys.argv[sys.argv.index("-o") + 1], "wb") as lib:
                lib.write(b"\\x7fELF half")
        time.sleep(float(os.environ["TINY_CXX_SLOW_S"]))
os.execvp("c++", ["c++", *sys.argv[1:]])
"""

_TINY_JOB = """
import ctypes, sys
from pathlib import Path
from shardkit.ops._builder import ExtensionBuilder
path = ExtensionBuilder(csrc=Path(sys.argv[1]), name="shardkit_tiny_kill").load()
print("tiny_add", ctypes.CDLL(path).tiny_add(2, 3), flush=True)
"""


def _tiny_extension(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A one-function C++ extension and the environment that builds it through a logging compiler into tmp_path."""
    csrc = tmp_path / "csrc"
    (csrc / "tiny").mkdir(parents=True)
    (csrc / "include").mkdir()
    (csrc / "tiny" / "tiny.cpp").write_text('extern "C" int tiny_add(int a, int b) { return a + b; }\n')
    wrapper = tmp_path / "logging-c++"
    wrapper.write_text(_CXX_WRAPPER.format(python=sys.executable))
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "SHARDKIT_DISABLE_CPP")}
    env.update(CXX=str(wrapper), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), TINY_CXX_LOG=str(tmp_path / "cxx.log"))
    return csrc, env


def _logged(tmp_path: Path) -> list[str]:
    log = tmp_path / "cxx.log"
    return log.read_text().splitlines() if log.exists() else []


def _process_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed, moment, steps", [
    ("job", "compile", ["compile", "compile", "link"]),  # the new job compiles again what the killed one did not finish
    ("job", "link", ["compile", "link", "link"]),  # ... and relinks the half-written library, never loads it
    ("build supervisor", "compile", ["compile", "link"]),  # the build goes on, holding the lock; the new job reuses it
])
def test_a_build_killed_mid_way_leaves_one_build_and_a_loadable_op(tmp_path, killed, moment, steps):
    """The issue's reproduction: a job killed by SIGKILL while its op compiles (or links, leaving a half-written
    library), then a new job. Never two compiles at once in the folder (the killed job's build ends with it, and
    the lock stays held while any process of it lives), and the new job loads a working op."""
    csrc, env = _tiny_extension(tmp_path)
    slow_s = 8 if killed == "build supervisor" else 60  # the job case: long enough to overlap an orphaned compile
    job = subprocess.Popen([sys.executable, "-c", _TINY_JOB, str(csrc)], env=dict(env, TINY_CXX_SLOW=moment,
                           TINY_CXX_SLOW_S=str(slow_s)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while not any(line.startswith(moment) for line in _logged(tmp_path)):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-3000:]
            time.sleep(0.2)
        victim = int(next(line for line in _logged(tmp_path) if line.startswith(moment)).split()[1])
        while _parent(victim) != job.pid:  # compiler <- sh <- ninja <- python -c build <- supervisor <- job
            victim = _parent(victim)
        victim = job.pid if killed == "job" else victim
        os.kill(victim, signal.SIGKILL)
        job.communicate(timeout=60)
        done = subprocess.run([sys.executable, "-c", _TINY_JOB, str(csrc)], env=env, capture_output=True, text=True,
                              timeout=200)
        assert done.returncode == 0 and "tiny_add 5" in done.stdout, done.stdout + done.stderr[-3000:]
        logged = _logged(tmp_path)
        assert not [line for line in logged if "CONCURRENT" in line], logged
        assert [line.split()[0] for line in logged] == steps
        strays = [int(line.split()[1]) for line in logged if _process_alive(int(line.split()[1]))]
        assert not strays, f"compilers of the killed build still run: {strays}"
        assert not (tmp_path / "ext" / "shardkit_tiny_kill" / "lock").exists()
    finally:
        job.kill()
        for line in _logged(tmp_path):  # on failure: leave no orphaned compiler behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[1]), signal.SIGKILL)
    CORPUS.append(f"{killed} killed by SIGKILL mid-{moment}: no second build beside it, the next job loads the op")


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
    built = re.search(r"building DeepSpeed shm_comm .*\n  ready in", done.stdout)
    assert ("loaded" in done.stdout) if entry == "zero_run" else built, done.stdout
    assert not (build_dir / "lock").exists()
    CORPUS.append("killed DeepSpeed build: next ZeRO run loads the op")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_io_with_a_killed_builds_baton_in_pin_memory_does_not_hang():
    """DeepSpeed's async_io loads its pin_memory op first, in pin_memory's own folder: a run killed there left torch's
    baton where no shardkit lock looked, and every later NVMe-offload run waited for ever (seen after a killed
    `shardkit build-ops --deepspeed`). async_io is built by `make test`'s scripts/build_ops.py before the tests."""
    pytest.importorskip("deepspeed")
    from shardkit.strategies.zero.config import libaio_available

    if not libaio_available():
        pytest.skip("libaio is not installed: DeepSpeed's async_io cannot build")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(_REPO / ".torch_extensions"))
    baton = _killed_build_baton(Path(env["TORCH_EXTENSIONS_DIR"]) / "pin_memory")
    code = ("from shardkit.strategies.zero.strategy import build_deepspeed_op; "
            "print('loaded', build_deepspeed_op('AsyncIOBuilder'))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0 and "loaded True" in done.stdout, done.stderr[-3000:] + done.stdout[-3000:]
    assert not baton.exists()
    CORPUS.append("killed DeepSpeed build in a nested op's folder (pin_memory): async_io still loads")


def test_print_corpus_counts():
    print(f"\nkilled-build corpus: {len(CORPUS)} probes passed: " + "; ".join(CORPUS))
