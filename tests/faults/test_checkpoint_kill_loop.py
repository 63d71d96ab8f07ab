"""Issue 13 H, J: kill -9 at every step of the save protocol, in loops, with no clean save in between.

A forked child saves with SHARDKIT_CHECKPOINT_FAULT=<step> and SIGKILLs itself when it reaches <step>.
After every kill a whole checkpoint must load (verified), and it must be the old one before the new
directory is in place and the new one from then on; the next save reclaims what the killed ones left.
Issue 27: the same for asynchronous saves, killed on their background thread while the main thread
overwrites the tensors it saved (training goes on).
"""

from __future__ import annotations

import os
import signal
import time
import traceback

import pytest
import torch

from shardkit.checkpoint import CheckpointReader, CheckpointWriter
from shardkit.checkpoint.async_save import AsyncCheckpointer
from shardkit.checkpoint.writer import FAULT_ENV, FAULT_STEPS

ROUNDS = 2


def _save(path, version, keep_last=None):
    with CheckpointWriter(path, keep_last=keep_last, info={"v": version}) as w:
        w.write_tensors("model", {f"p{i}": torch.full((256,), float(version)) for i in range(4)})
        w.write_json("state", {"v": version})


def _save_async(path, version, keep_last=None):
    """A background save of version ``version``; the main thread then overwrites the tensors, as a step would."""
    tensors = {f"p{i}": torch.full((256,), float(version)) for i in range(4)}

    def fill(w):
        w.write_tensors("model", tensors)
        w.write_json("state", {"v": version})

    saves = AsyncCheckpointer(rank=0, world_size=1, timeout_s=60)
    saves.save(path, lambda barrier: CheckpointWriter(path, keep_last=keep_last, info={"v": version}, barrier=barrier),
               fill)
    for t in tensors.values():
        t.fill_(-1.0)  # the training step changes the live tensors while the thread writes the copies
    saves.close()


def _save_in_child(path, version, fault, keep_last=None, save=_save):
    """Runs ``save`` in a forked child with the fault hook set; returns the signal that ended it, or 0."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            os.environ[FAULT_ENV] = fault
            save(path, version, keep_last)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"save killed at {fault!r} hung")
        time.sleep(0.005)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status)
    assert os.WEXITSTATUS(status) == 0, f"save with fault {fault!r} failed (see stderr)"
    return 0


def _loaded_version(path):
    """The version a verified load sees; every tensor must agree with it bit for bit."""
    with CheckpointReader(path) as r:
        v = r.read_json("state")["v"]
        for key, t in r.read_tensors("model").items():
            assert torch.equal(t, torch.full((256,), float(v))), f"{key} is not whole version {v}"
        return v


def _hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p.name != ".shardkit.lock")


def test_kills_at_every_step_over_one_name(tmp_path):
    """Saves over the same name, every one killed: the old copy or the new one always loads (H)."""
    root = tmp_path / "ckpt"
    _save(root / "final", 0)
    current, version, kills = 0, 0, 0
    for _ in range(ROUNDS):
        for step in FAULT_STEPS:
            version += 1
            sig = _save_in_child(root / "final", version, step)
            kills += sig == signal.SIGKILL
            in_place = sig == 0 or FAULT_STEPS.index(step) >= FAULT_STEPS.index("old-moved")
            got = _loaded_version(root)
            assert got == (version if in_place else current), f"killed at {step}: loaded {got}"
            assert _loaded_version(root / "final") == got if (root / "final").exists() else True
            assert len(_hidden(root)) <= 3, f"leftovers pile up after {step}: {_hidden(root)}"
            current = got
    assert kills >= ROUNDS * (len(FAULT_STEPS) - 2)  # the prune steps only fire with keep_last
    _save(root / "final", version + 1)
    assert _hidden(root) == [] and _loaded_version(root) == version + 1  # J: everything reclaimed


@pytest.mark.parametrize("save", [_save, _save_async], ids=["sync", "async"])
def test_kills_at_every_step_with_new_names_and_pruning(tmp_path, save):
    """New names with keep_last=2: `latest` always names a whole checkpoint, pruning never loses it; a background
    save killed at any step is the same, and holds the values of the moment it was called."""
    root = tmp_path / "ckpt"
    _save(root / "step-0", 0, keep_last=2)
    current, version = 0, 0
    for _ in range(ROUNDS if save is _save else 1):
        for step in FAULT_STEPS:
            version += 1
            sig = _save_in_child(root / f"step-{version}", version, step, keep_last=2, save=save)
            moved = sig == 0 or FAULT_STEPS.index(step) >= FAULT_STEPS.index("latest-moved")
            got = _loaded_version(root)
            assert got == (version if moved else current), f"killed at {step}: loaded {got}"
            if (root / f"step-{version}").exists():  # whatever became visible is whole
                assert _loaded_version(root / f"step-{version}") == version
            current = got
    _save(root / f"step-{version + 1}", version + 1, keep_last=2)
    visible = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    assert _hidden(root) == [] and len(visible) == 2 and f"step-{version + 1}" in visible


def test_two_kills_in_a_row_between_the_renames_and_after_the_old_copy(tmp_path):
    """The sequence of issue 13 H: kill between the two renames, re-save, kill after the old copy is gone."""
    root = tmp_path / "ckpt"
    _save(root / "final", 1)
    assert _save_in_child(root / "final", 2, "old-moved") == signal.SIGKILL
    assert not (root / "final").exists() and _loaded_version(root) == 2  # read from the hidden complete copy
    assert _save_in_child(root / "final", 3, "old-removed") == signal.SIGKILL
    assert _loaded_version(root) == 3 and _loaded_version(root / "final") == 3
    assert _save_in_child(root / "final", 4, "file-written") == signal.SIGKILL
    assert _loaded_version(root) == 3
    _save(root / "final", 5)
    assert _loaded_version(root) == 5 and _hidden(root) == []
