"""Issue 13 I: two saves to one path at once. One wins whole; the other fails with CheckpointBusyError
and touches nothing (its ranks included)."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import pytest
import torch

from shardkit.checkpoint import CheckpointBusyError, CheckpointReader, CheckpointWriter, ShardPiece
from shardkit.checkpoint.writer import FAULT_ENV

BUSY = 3


def _save(path, version, tensors=4):
    with CheckpointWriter(path, info={"v": version}) as w:
        w.write_tensors("model", {f"p{i}": torch.full((1024,), float(version)) for i in range(tensors)})
        w.write_json("state", {"v": version})


def _version(path):
    with CheckpointReader(path) as r:
        v = r.read_json("state")["v"]
        assert all(torch.equal(t, torch.full_like(t, float(v))) for t in r.read_tensors("model").values())
        return v


def _fork(fn, *args, env=None):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.update(env or {})
            fn(*args)
            code = 0
        except CheckpointBusyError:
            code = BUSY
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def _wait(pid, flags=0, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, flags | os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("child hung")
        time.sleep(0.005)


@pytest.mark.parametrize("step", ["locked", "tmp-created", "file-written", "part-written", "manifest-written",
                                  "old-moved", "renamed", "latest-written"])
def test_a_save_parked_at_any_step_makes_the_second_fail(tmp_path, step):
    root = tmp_path / "ckpt"
    _save(root / "final", 1)
    a = _fork(_save, root / "final", 2, env={FAULT_ENV: f"{step}:stop"})
    status = _wait(a, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"save A never reached {step}"
    try:
        with pytest.raises(CheckpointBusyError, match=r"another save .* is in progress \(process \d+"):
            _save(root / "final", 3)
        assert _version(root) in (1, 2)  # readers meanwhile see a whole checkpoint
    finally:
        os.kill(a, signal.SIGCONT)
    status = _wait(a)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert _version(root) == 2  # A won whole; B changed nothing
    _save(root / "final", 4)  # the lock went with A
    assert _version(root) == 4


def test_simultaneous_saves_one_wins_whole(tmp_path):
    root, outcomes = tmp_path / "ckpt", []
    for rnd in range(8):
        go_r, go_w = os.pipe()

        def racer(version, go=go_r):
            os.read(go, 1)  # both start together
            _save(root / "final", version, tensors=32)

        pids = [_fork(racer, 10 * rnd + i) for i in (1, 2)]
        os.write(go_w, b"xx")
        os.close(go_r), os.close(go_w)
        codes = [os.WEXITSTATUS(_wait(p)) for p in pids]
        assert set(codes) <= {0, BUSY} and 0 in codes, codes
        winners = {10 * rnd + i for i, c in zip((1, 2), codes) if c == 0}
        assert _version(root) in winners
        outcomes.append(tuple(codes))
    print(f"simultaneous saves: {sum(BUSY in c for c in outcomes)} of {len(outcomes)} rounds had a loser")


class _Group:
    """Thread ranks of one job: a barrier and a broadcast from rank 0."""

    def __init__(self, n):
        self.n, self._barrier, self._slot = n, threading.Barrier(n, timeout=60), None

    def barrier(self):
        self._barrier.wait()

    def broadcast_from(self, rank):
        def broadcast(obj):
            if rank == 0:
                self._slot = obj
            self._barrier.wait()
            out = self._slot
            self._barrier.wait()
            return out
        return broadcast


def _run_job(path, version, group, parked=None, resume=None):
    errors = [None] * group.n

    def rank_fn(rank):
        try:
            with CheckpointWriter(path, rank=rank, world_size=group.n, barrier=group.barrier,
                                  broadcast=group.broadcast_from(rank), info={"v": version}) as w:
                full = torch.full((group.n * 4,), float(version))
                w.write_shard("model", {"x": ShardPiece(full[rank * 4:(rank + 1) * 4], tuple(full.shape),
                                                        flat_range=(rank * 4, rank * 4 + 4))})
                if rank == 0:
                    w.write_json("state", {"v": version})
                if parked is not None:
                    parked.set()
                    assert resume.wait(60)
        except BaseException as e:  # noqa: BLE001 - collected for the test to inspect
            errors[rank] = e

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(group.n)]
    for t in threads:
        t.start()
    return threads, errors


def test_second_multi_rank_job_fails_on_every_rank_and_never_writes_into_the_first(tmp_path):
    path = tmp_path / "ckpt" / "final"
    parked, resume = threading.Event(), threading.Event()
    a_threads, a_errors = _run_job(path, 1, _Group(2), parked, resume)
    assert parked.wait(60)
    b_threads, b_errors = _run_job(path, 2, _Group(2))
    for t in b_threads:
        t.join(60)
    resume.set()
    for t in a_threads:
        t.join(60)
    assert a_errors == [None, None], a_errors
    assert all(isinstance(e, CheckpointBusyError) for e in b_errors), b_errors
    with CheckpointReader(path.parent) as r:
        assert r.read_json("state") == {"v": 1}
        assert torch.equal(r.read_full("model", "x"), torch.full((8,), 1.0))
