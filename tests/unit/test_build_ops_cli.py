"""`shardkit build-ops`: builds the ops ahead into the folder runs use and says what and where; one folder per
virtual environment when TORCH_EXTENSIONS_DIR is unset."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import shardkit.ops
from shardkit import cli
from shardkit.cli.build_ops import build_ops
from shardkit.ops import _builder


def test_build_ops_builds_the_shardkit_ops_into_the_given_folder_and_names_it(tmp_path, monkeypatch, capsys):
    csrc = tmp_path / "csrc"
    (csrc / "tiny").mkdir(parents=True)
    (csrc / "include").mkdir()
    (csrc / "tiny" / "tiny.cpp").write_text('extern "C" int tiny_add(int a, int b) { return a + b; }\n')
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(shardkit.ops, "BUILDER", _builder.ExtensionBuilder(csrc=csrc, name="shardkit_tiny_cli"))

    assert cli.main(["build-ops"]) == 0
    out = capsys.readouterr().out
    library = tmp_path / "ext" / "shardkit_tiny_cli" / "shardkit_tiny_cli.so"
    assert f"ops folder: {tmp_path / 'ext'} (TORCH_EXTENSIONS_DIR)" in out
    built = rf"building shardkit_C \(shardkit's C\+\+ ops\) \.\.\.\n  ready in \d+ s: {re.escape(str(library))}"
    assert re.search(built, out), out
    assert library.is_file() and "DeepSpeed" not in out


def test_build_ops_deepspeed_names_each_op_and_why_async_io_is_skipped(tmp_path, monkeypatch):
    """Without libaio, async_io is skipped with the reason and the fix; the others are built (here: recorded, the
    real builds of the same list run in `make test`'s scripts/build_ops.py and tests/faults/test_build_lock.py)."""
    pytest.importorskip("deepspeed")
    from shardkit.strategies.zero import config, strategy

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))
    monkeypatch.setattr(config, "libaio_available", lambda: False)
    built = []
    monkeypatch.setattr(strategy, "build_deepspeed_op", lambda name: built.append(name) or True)
    out = io.StringIO()

    assert build_ops(deepspeed=True, shardkit_ops=False, out=out)
    text = out.getvalue()
    assert "skipping DeepSpeed async_io (NVMe offload): libaio not found" in text and "libaio-dev" in text, text
    assert built == strategy.deepspeed_op_builders(offload=True, nvme=False) and "CPUAdamBuilder" in built
    assert re.search(rf"building DeepSpeed cpu_adam \(optimizer offload\) \.\.\.\n  ready in \d+ s: "
                     rf"{re.escape(str(tmp_path / 'ext' / 'cpu_adam'))}", text), text


_WHERE = """
from torch.utils.cpp_extension import _get_build_directory
from shardkit.ops.build_lock import extensions_root
print(extensions_root())
print(_get_build_directory("cpu_adam", verbose=False))  # where DeepSpeed's loads build, through torch
"""


def test_two_environments_get_their_own_default_ops_folder(tmp_path):
    """torch's default folder (~/.cache/torch_extensions/py311_cpu) is per user only: two virtual environments
    sharing it rebuilt each other's ops. Unless TORCH_EXTENSIONS_DIR says otherwise, each has its own, and DeepSpeed's
    builds (torch's folder lookup) follow it."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    folders = []
    for name in ("venv_a", "venv_b"):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / name)], check=True, timeout=120)
        python = tmp_path / name / "bin" / "python"
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # addsitedir, not a bare path: the lent site's own .pth files run too (shardkit's editable-install finder)
        lent = sysconfig.get_paths()["purelib"]
        Path(site, "lent_packages.pth").write_text(f"import site; site.addsitedir({lent!r})\n")
        done = subprocess.run([str(python), "-c", _WHERE], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        root, deepspeed_op = done.stdout.split()[-2:]
        assert Path(deepspeed_op) == Path(root) / "cpu_adam"
        folders.append(Path(root))
    assert folders[0] != folders[1], folders
    for folder in folders:
        assert folder.parent == (tmp_path / "cache" / "torch_extensions").resolve(), folder
        assert re.fullmatch(r"py3\d+\w*_\w+-torch[\d.]+\w*-[0-9a-f]{10}", folder.name), folder.name


def _path_with_another_ninja(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """PATH with a ``ninja`` that is not this environment's first (as the system's 1.11 is when `make test` runs
    ``.venv/bin/python`` unactivated); it logs its calls and fails. Returns (its log, this environment's ninja)."""
    ours = Path(sysconfig.get_path("scripts")) / "ninja"
    if not ours.is_file():
        pytest.skip("this environment has no ninja of its own (pip install ninja)")
    other = tmp_path / "other-bin"
    other.mkdir()
    log = tmp_path / "other-ninja.log"
    (other / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexit 1\n')
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ.get('PATH', '')}")
    return log, ours


def test_a_build_runs_this_environments_ninja_whatever_path_finds_first(tmp_path, monkeypatch):
    """ninja's log hashes each command, and ninja 1.11 and 1.13 hash differently: a folder built by one was compiled
    again, every object, by the other (DeepSpeed's cpu_adam and async_io: minutes, inside a test or a run)."""
    import shutil

    from shardkit.ops.build_lock import environment_ninja

    log, ours = _path_with_another_ninja(tmp_path, monkeypatch)
    csrc = tmp_path / "csrc"
    (csrc / "tiny").mkdir(parents=True)
    (csrc / "include").mkdir()
    (csrc / "tiny" / "tiny.cpp").write_text('extern "C" int tiny_add(int a, int b) { return a + b; }\n')
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    library = _builder.ExtensionBuilder(csrc=csrc, name="shardkit_tiny_ninja").load()
    assert Path(library).is_file() and not log.exists(), log.read_text() if log.exists() else ""
    with environment_ninja():
        assert shutil.which("ninja") == str(ours)
    assert shutil.which("ninja") == str(tmp_path / "other-bin" / "ninja")  # PATH is given back


def test_a_built_deepspeed_op_loads_with_this_environments_ninja(tmp_path, monkeypatch):
    """After the build, DeepSpeed's load (torch's JIT load: it runs ninja on the folder) runs the same ninja."""
    import shutil

    deepspeed = pytest.importorskip("deepspeed")
    import torch
    from deepspeed.accelerator import get_accelerator

    from shardkit.strategies.zero.strategy import build_deepspeed_op, choose_deepspeed_accelerator

    _, ours = _path_with_another_ninja(tmp_path, monkeypatch)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    choose_deepspeed_accelerator()
    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    folder = tmp_path / "ext" / builder.NAME
    folder.mkdir(parents=True)
    (folder / f".shardkit-built-{deepspeed.__version__}-{torch.__version__}").touch()  # built: only the load runs
    (folder / f"{builder.NAME}.so").touch()
    found = []
    monkeypatch.setattr("shardkit.ops.build_lock.ninja_has_work", lambda folder: False)  # up to date to ninja
    monkeypatch.setattr(type(builder), "load", lambda self, verbose=False: found.append(shutil.which("ninja")))
    assert build_deepspeed_op("CPUAdamBuilder")
    assert found == [str(ours)]


def test_ninja_has_work_sees_a_folder_that_is_out_of_date_to_ninja(tmp_path):
    """A dry run of this environment's ninja: up to date after a build, out of date once an input is newer (what a
    `cp -r` of an ops folder looks like to ninja) or without a build.ninja."""
    import os
    import subprocess

    from shardkit.ops.build_lock import environment_ninja, ninja_has_work

    assert ninja_has_work(tmp_path)  # no build.ninja
    (tmp_path / "in.txt").write_text("x")
    (tmp_path / "build.ninja").write_text("rule copy\n  command = cp $in $out\nbuild out.txt: copy in.txt\n")
    with environment_ninja():
        subprocess.run(["ninja", "-C", str(tmp_path)], check=True, capture_output=True)
    assert not ninja_has_work(tmp_path)
    later = os.stat(tmp_path / "out.txt").st_mtime + 10
    os.utime(tmp_path / "in.txt", (later, later))
    assert ninja_has_work(tmp_path)


def test_a_built_deepspeed_op_out_of_date_to_ninja_is_rebuilt_under_the_supervisor(tmp_path, monkeypatch):
    """Marker and library present, but ninja would compile: the build runs in the supervised child before the load,
    never inside the loading process."""
    deepspeed = pytest.importorskip("deepspeed")
    import torch
    from deepspeed.accelerator import get_accelerator

    from shardkit.strategies.zero.strategy import build_deepspeed_op, choose_deepspeed_accelerator

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    choose_deepspeed_accelerator()
    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    folder = tmp_path / "ext" / builder.NAME
    folder.mkdir(parents=True)
    (folder / f".shardkit-built-{deepspeed.__version__}-{torch.__version__}").touch()
    (folder / f"{builder.NAME}.so").touch()
    order = []
    monkeypatch.setattr("shardkit.ops.build_lock.ninja_has_work", lambda f: not order)  # stale until rebuilt
    monkeypatch.setattr("shardkit.ops.build_lock.run_build_subprocess",
                        lambda code, label, where: order.append(("supervised build", where)))
    monkeypatch.setattr(type(builder), "load", lambda self, verbose=False: order.append(("load", None)))
    assert build_deepspeed_op("CPUAdamBuilder")
    assert order == [("supervised build", folder), ("load", None)]
