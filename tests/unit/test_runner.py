import pytest
import torch

from shardkit import FP32, Runner, SingleDevice
from shardkit.checkpoint import CheckpointError
from shardkit.models import Llama, LlamaConfig
from shardkit.strategies import strategy_from_name

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)


def _setup(accum: int = 1):
    runner = Runner(SingleDevice("cpu"), FP32(), gradient_accumulation_steps=accum, seed=0)
    model = Llama(TINY)
    model, optimizer = runner.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return runner, model, optimizer


def test_loss_falls_on_a_fixed_batch():
    runner, model, _ = _setup()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(20):
        loss = model(ids, ids)
        runner.backward(loss)
        runner.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]


def test_step_waits_for_the_end_of_the_window():
    runner, model, _ = _setup(accum=3)
    ids = torch.randint(0, 256, (2, 16))
    results = []
    for _ in range(6):
        runner.backward(model(ids, ids))
        results.append((runner.sync_gradients, runner.clip_gradients(1.0) is not None, runner.step()))
    assert results == [(False, False, False), (False, False, False), (True, True, True)] * 2
    assert runner.optimizer_steps == 2


def test_clip_gradients_returns_the_norm_before_clipping():
    runner, model, _ = _setup()
    ids = torch.randint(0, 256, (2, 16))
    runner.backward(model(ids, ids))
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = runner.clip_gradients(1e-3)
    torch.testing.assert_close(norm, expected)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped == pytest.approx(1e-3, rel=1e-3)


def test_load_names_a_missing_entry(tmp_path):
    runner, model, optimizer = _setup()
    runner.save(tmp_path / "ckpt" / "a", {"model": model, "epoch": 3})
    with pytest.raises(CheckpointError, match="'optimizer'"):
        runner.load(tmp_path / "ckpt", {"model": model, "optimizer": optimizer})
    assert runner.load(tmp_path / "ckpt", {"model": model})["epoch"] == 3


def test_load_refuses_a_kind_mismatch(tmp_path):
    runner, model, optimizer = _setup()
    runner.save(tmp_path / "a", {"model": model, "optimizer": optimizer})
    with pytest.raises(CheckpointError, match="saved as a module"):
        runner.load(tmp_path / "a", {"model": optimizer, "optimizer": optimizer})


class _RankState:
    """Per-rank state (``checkpoint_per_rank``): each rank saves and loads its own."""

    checkpoint_per_rank = True

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_a_per_rank_object_is_its_ranks_entry_of_the_atomic_save(tmp_path):
    """Saved as ``<key>.rank<N>`` in the same checkpoint, snapshotted at the save, loaded back by its rank; a stateful
    object of another kind is refused, and a rank missing from the checkpoint is named."""
    import json

    from shardkit.checkpoint import CheckpointReader
    from shardkit.checkpoint.format import MANIFEST

    runner, model, _ = _setup()
    held = torch.arange(3.0)
    runner.save(tmp_path / "a", {"model": model, "mine": _RankState(held)}, blocking=False)
    held.add_(10.0)  # after the save was made: the background write must not see it
    runner.wait_for_save()
    with CheckpointReader(tmp_path / "a") as reader:
        assert reader.read_json("entries")["mine"] == "rank_stateful" and not reader.has("mine")
    loaded = _RankState(None)
    runner.load(tmp_path / "a", {"model": model, "mine": loaded})
    assert torch.equal(loaded.value, torch.arange(3.0))
    with pytest.raises(CheckpointError, match="'mine' was saved as a rank_stateful"):
        runner.load(tmp_path / "a", {"model": model, "mine": torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda step: 1.0)})
    manifest = json.loads((tmp_path / "a" / MANIFEST).read_text())
    del manifest["entries"]["mine.rank00000"]
    (tmp_path / "a" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="'mine' holds one state per rank and has none for rank 0"):
        runner.load(tmp_path / "a", {"model": model, "mine": loaded})


def test_methods_need_setup_first():
    runner = Runner(SingleDevice("cpu"))
    with pytest.raises(RuntimeError, match=r"runner.setup\(\)"):
        runner.backward(torch.tensor(1.0, requires_grad=True))


def test_unknown_strategy_suggests_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'ddp'"):
        strategy_from_name("ddpx")


def test_print_only_on_the_main_process(capsys):
    runner = Runner(SingleDevice("cpu"))
    runner.print("hello")
    runner.print("everyone", all_ranks=True)
    assert capsys.readouterr().out == "hello\n[rank 0] everyone\n"
