"""Issue 27: ``runner.save(path, state, blocking=False)``: the state of the call, written in the background.

The kill -9 loop over every step of the protocol is in tests/faults/test_checkpoint_kill_loop.py, and every
registered strategy's exact resume from a background save on 2 ranks in tests/contract.
"""

from __future__ import annotations

import errno
import threading

import pytest
import torch

from shardkit import Runner
from shardkit.checkpoint import CheckpointError, CheckpointReader
from shardkit.checkpoint import writer as writer_module
from shardkit.checkpoint.staging import StagingWriter


def _build(seed: int = 0):
    runner = Runner(seed=seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = runner.setup(model, optimizer, scheduler)
    return runner, model, optimizer, scheduler


def _steps(runner, model, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x = torch.randn(8, 16)  # the RNG is part of the checkpoint: a resumed run draws the same batches
        loss = model(x).pow(2).mean()
        runner.backward(loss)
        runner.step()
        losses.append(loss.item())
    return losses


def _state(model, optimizer, scheduler, step):
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": step}


def _contents(path):
    with CheckpointReader(path) as r:
        out = {"model": r.read_tensors("model"), "optimizer": r.read_state("optimizer"),
               "values": r.read_state("values"), "rng": r.read_state("rng.rank00000")}
    return out


def _same(a, b) -> bool:
    """Nested dicts, lists and tuples of tensors and plain values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return repr(a) == repr(b)


def test_background_save_holds_the_call_state_and_resumes_exactly(tmp_path):
    """Training changes every tensor while the thread writes: the checkpoint is the one a blocking save at the
    same moment writes, bit for bit, and a run resumed from it equals the uninterrupted run."""
    runner, model, optimizer, scheduler = _build()
    _steps(runner, model, 3)
    runner.save(tmp_path / "sync-3", _state(model, optimizer, scheduler, 3))
    runner.save(tmp_path / "async-3", _state(model, optimizer, scheduler, 3), blocking=False)
    straight = _steps(runner, model, 3)  # while the background thread writes
    assert runner.wait_for_save() == tmp_path / "async-3"
    final = {k: v.clone() for k, v in model.state_dict().items()}
    sync, background = _contents(tmp_path / "sync-3"), _contents(tmp_path / "async-3")
    assert background["values"] == {"step": 3}
    for key in ("model", "rng", "optimizer"):
        assert _same(sync[key], background[key]), key

    runner2, model2, optimizer2, scheduler2 = _build(seed=7)
    assert runner2.load(tmp_path, _state(model2, optimizer2, scheduler2, 0)) == {"step": 3}  # `latest`: async-3
    assert _steps(runner2, model2, 3) == straight
    assert all(torch.equal(final[k], v) for k, v in model2.state_dict().items())


def test_failed_background_save_raises_on_the_next_call_naming_it(tmp_path, monkeypatch):
    runner, model, optimizer, scheduler = _build()
    runner.save(tmp_path / "step-1", _state(model, optimizer, scheduler, 1))
    real = writer_module.write_safetensors

    def disk_full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(writer_module, "write_safetensors", disk_full)
    runner.save(tmp_path / "step-2", _state(model, optimizer, scheduler, 2), blocking=False)
    with pytest.raises(CheckpointError, match=r"background save of .*step-2 failed.*No space left") as info:
        runner.save(tmp_path / "step-3", _state(model, optimizer, scheduler, 3), blocking=False)
    assert "previous checkpoint and `latest` are unchanged" in str(info.value)
    assert not (tmp_path / "step-3").exists()  # the failure is raised before the next save starts
    assert (tmp_path / "latest").read_text().strip() == "step-1" and not (tmp_path / "step-2").exists()
    monkeypatch.setattr(writer_module, "write_safetensors", real)
    runner.save(tmp_path / "step-3", _state(model, optimizer, scheduler, 3), blocking=False)
    runner.teardown()  # waits for it
    assert (tmp_path / "latest").read_text().strip() == "step-3"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".shardkit.lock") == ["latest", "step-1", "step-3"]


def test_one_save_in_flight_and_latest_moves_only_when_complete(tmp_path, monkeypatch):
    """While the first save's thread is held, `latest` and the directory are not there; a second save waits for
    the first to be published before it opens its own."""
    runner, model, optimizer, scheduler = _build()
    release, order = threading.Event(), []
    replay = StagingWriter.replay

    def held_replay(self, writer, on_call=None):
        if self.path.name == "step-1":
            assert release.wait(60)
        replay(self, writer, on_call)
        order.append(f"written {self.path.name}")

    opened = writer_module.CheckpointWriter.open

    def logged_open(self):
        order.append(f"open {self.path.name}")
        opened(self)

    monkeypatch.setattr(StagingWriter, "replay", held_replay)
    monkeypatch.setattr(writer_module.CheckpointWriter, "open", logged_open)
    runner.save(tmp_path / "step-1", _state(model, optimizer, scheduler, 1), blocking=False)
    assert runner.checkpoints.background.in_flight == tmp_path / "step-1"
    assert not (tmp_path / "latest").exists() and not (tmp_path / "step-1").exists()
    second = threading.Thread(target=runner.save, args=(tmp_path / "step-2", _state(model, optimizer, scheduler, 2)),
                              kwargs={"blocking": False})
    second.start()
    second.join(0.5)
    assert order == ["open step-1"]  # the second save is waiting for the first
    release.set()
    second.join(60)
    runner.wait_for_save()
    assert order == ["open step-1", "written step-1", "open step-2", "written step-2"]
    assert (tmp_path / "latest").read_text().strip() == "step-2"
    with CheckpointReader(tmp_path / "step-1") as r:  # verified: every hash checked
        assert r.read_state("values") == {"step": 1}


def test_tied_weights_stay_tied_and_host_buffers_are_reused(tmp_path):
    runner = Runner()
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight
    model = runner.setup(model)
    runner.save(tmp_path / "a", {"model": model}, blocking=False)
    first = runner.checkpoints.background.buffers.nbytes
    runner.save(tmp_path / "b", {"model": model}, blocking=False)
    runner.wait_for_save()
    saves = runner.checkpoints.background
    assert first == saves.buffers.nbytes == saves.last.nbytes  # reused, tied once
    with CheckpointReader(tmp_path / "b") as r:
        tensors = r.read_tensors("model")
    assert tensors["0.weight"] is tensors["1.weight"]
    torch.testing.assert_close(tensors["0.weight"], model[0].weight.detach(), rtol=0, atol=0)


def test_a_tensor_changed_between_two_writes_is_copied_again(tmp_path):
    """Tied views are copied once within a call; across calls an address may hold other data (a strategy's
    temporaries are freed and reused between writes, as ZeRO-3's fragments are), so each call copies afresh."""
    staged = StagingWriter(tmp_path / "x", rank=0, world_size=1)
    t = torch.zeros(4)
    staged.write_tensors("a", {"w": t, "tied": t})
    t.fill_(1.0)
    staged.write_tensors("b", {"w": t})
    staged.write_state("c", {"w": t.fill_(2.0)})
    (_, (_, a, _)), (_, (_, b, _)), (_, (_, c)) = staged._calls
    assert a["w"] is a["tied"] and a["w"].sum() == 0 and b["w"].sum() == 4 and c["w"].sum() == 8
