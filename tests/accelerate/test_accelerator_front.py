"""shardkit.Accelerator in one process (no process group): Accelerate's meanings, checked against plain PyTorch.

- the accumulation window: ``sync_gradients``, the prepared optimizer and scheduler that act only when a window
  ends (the end of a data loader included), the loss divided by the window, no window outside ``accumulate``;
- fp16 overflow: ``step_was_skipped``, the scheduler holds;
- ``prepare`` in any order and mix, several models and optimizers saved and loaded together, automatic checkpoint
  naming with ``total_limit``, ``register_for_checkpointing``, ``skip_first_batches`` against a restored position;
- clipping, ``unwrap_model``, ``free_memory``, trackers read back with their own readers;
- every constructor keyword and kwargs handler mapped onto Strategy and Precision, or refused by name.
"""

from __future__ import annotations

import gc
import json
import math
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from shardkit import BF16, FP16, Accelerator
from shardkit.accelerate_compat import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProjectConfiguration,
    set_seed,
)
from shardkit.accelerate_compat.plugins import deepspeed_config, fsdp_strategy
from shardkit.observability.trackers import TRACKERS


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _data(n: int = 7) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _loss(model, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


# ---- the accumulation window -------------------------------------------------------------------------------

def test_accumulate_windows_follow_accelerate_and_match_plain_pytorch():
    accelerator = Accelerator(gradient_accumulation_steps=3)
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    loader = DataLoader(_data(7), batch_size=1)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    assert accelerator.sync_gradients  # Accelerate's meaning: True outside accumulate()
    seen, lrs = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model, batch))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            seen.append((accelerator.sync_gradients, accelerator.gradient_state.end_of_dataloader))
        lrs.append(optimizer.param_groups[0]["lr"])
    # windows end after micro-batches 3 and 6, and at the loader's end (7): there the step and schedule act
    assert [s for s, _ in seen] == [False, False, True, False, False, True, True]
    assert [e for _, e in seen] == [False] * 6 + [True]
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.0125]
    assert accelerator.runner.optimizer_steps == 3 and not accelerator.gradient_state.in_dataloader

    plain = torch.optim.SGD(reference.parameters(), lr=0.1)  # what the windows mean, written out
    batches = list(DataLoader(_data(7), batch_size=1))
    for window, lr in ((batches[0:3], 0.1), (batches[3:6], 0.05), (batches[6:7], 0.025)):
        for g in plain.param_groups:
            g["lr"] = lr
        for batch in window:
            (_loss(reference, batch) / 3).backward()
        plain.step()
        plain.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_outside_accumulate_every_step_steps_with_the_loss_divided():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in DataLoader(_data(4), batch_size=2):
        accelerator.backward(_loss(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        (_loss(reference, batch) / 2).backward()  # Accelerate divides by the steps even outside accumulate()
        plain.step()
        plain.zero_grad()
    assert accelerator.runner.optimizer_steps == 2
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_plugin_without_sync_with_dataloader_keeps_the_window_across_the_loader_end():
    plugin = GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(_data(3), batch_size=1))
    pattern = []
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(_loss(model, batch))
                pattern.append(accelerator.sync_gradients)
    assert pattern == [False, True, False, True, False, True]
    with pytest.raises(ValueError, match="not both"):
        Accelerator(gradient_accumulation_steps=2, gradient_accumulation_plugin=plugin)


def test_fp16_overflow_skips_the_step_and_holds_the_schedule():
    accelerator = Accelerator(mixed_precision="fp16")
    assert isinstance(accelerator.runner.precision, FP16) and accelerator.mixed_precision == "fp16"
    # torch's GradScaler defaults: 2**16, doubled after 2000 good steps, halved at every overflow
    assert accelerator.runner.precision.loss_scale_window == 2000 and accelerator.runner.precision.hysteresis == 1
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(2, 3)
    accelerator.backward(model(x).float().mean() * float("inf"))
    optimizer.step()
    scheduler.step()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert accelerator.runner.precision.current_loss_scale == 2.0 ** 15
    optimizer.zero_grad()
    accelerator.backward(model(x).float().mean())  # (a sum's bias gradient, 2 * 2**15, would overflow fp16)
    optimizer.step()
    scheduler.step()
    assert not optimizer.step_was_skipped and optimizer.param_groups[0]["lr"] == 0.05


# ---- prepare, checkpoints, data position -------------------------------------------------------------------

def test_prepare_takes_any_order_and_pairs_optimizers_with_their_models():
    accelerator = Accelerator()
    gen, disc = _model(0), _model(1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.2)
    loader = DataLoader(_data(4), batch_size=2)
    out = accelerator.prepare(opt_d, loader, gen, disc, opt_g, "kept")
    assert [type(o).__name__ for o in out] == ["AcceleratedOptimizer", "PreparedDataLoader", "Sequential",
                                               "Sequential", "AcceleratedOptimizer", "str"]
    assert out[0].optimizer is opt_d and out[4].optimizer is opt_g and out[5] == "kept"
    assert accelerator.prepare(out[1]) is out[1]  # prepared already: returned as it is
    with pytest.raises(ValueError, match="one prepare"):
        accelerator.prepare(torch.optim.SGD(_model(2).parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="prepare_optimizer"):
        accelerator.prepare_optimizer(opt_g)


def test_two_models_save_and_load_together(tmp_path):
    def build():
        accelerator = Accelerator()
        gen, disc = _model(0), _model(1)
        return accelerator, *accelerator.prepare(gen, disc, torch.optim.Adam(gen.parameters(), lr=0.01),
                                                 torch.optim.Adam(disc.parameters(), lr=0.02))

    def step(accelerator, gen, disc, opt_g, opt_d):
        x = torch.randn(2, 3)
        accelerator.backward(gen(x).sum() + disc(x).pow(2).sum())
        opt_g.step()
        opt_d.step()
        opt_g.zero_grad()
        opt_d.zero_grad()

    first = build()
    step(*first)
    first[0].save_state(tmp_path / "gan")
    torch.manual_seed(5)
    step(*first)
    second = build()
    second[0].load_state(tmp_path / "gan")
    torch.manual_seed(5)
    step(*second)
    for a, b in zip([*first[1].parameters(), *first[2].parameters()], [*second[1].parameters(),
                                                                        *second[2].parameters()]):
        assert torch.equal(a, b)


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_automatic_checkpoint_naming_keeps_total_limit_and_restores_everything(tmp_path):
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(project_config=config, gradient_accumulation_steps=2)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(_data(8), batch_size=1,
                                                                                shuffle=True))
    order, saved = [], None
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        counter.count += 1
        order.append(batch[0])
        if accelerator.sync_gradients and counter.count < 8:  # after batches 2, 4 and 6
            saved = accelerator.save_state()
            weights = [p.detach().clone() for p in model.parameters()]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("."))
    assert names == ["checkpoint_1", "checkpoint_2", "latest"] and saved.endswith("checkpoint_2")
    with pytest.raises(ValueError, match="must be a whole number|state_dict"):
        accelerator.register_for_checkpointing(object())

    again = Accelerator(project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                            automatic_checkpoint_naming=True, total_limit=2))
    restored = Counter()
    again.register_for_checkpointing(restored)
    model2 = _model(7)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    model2, optimizer2, loader2 = again.prepare(model2, optimizer2, DataLoader(_data(8), batch_size=1,
                                                                               shuffle=True))
    again.load_state()  # the newest: checkpoint_2, after the 6th batch
    assert restored.count == 6 and again.step == 6 and again.save_iteration == 3
    assert all(torch.equal(a, b) for a, b in zip(weights, model2.parameters()))
    rest = torch.stack([b[0] for b in again.skip_first_batches(loader2, 6)])  # agrees with the restored position
    assert torch.equal(rest, torch.stack(order[6:]))
    with pytest.raises(ValueError, match="already exists"):
        again.project_configuration.iteration = 2
        again.save_state()


def test_skip_first_batches_starts_the_next_epoch_mid_way():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(_data(5), batch_size=1, shuffle=True))
    epoch0 = torch.cat([b[0] for b in loader])
    epoch1 = torch.cat([b[0] for b in loader])
    fresh = Accelerator().prepare(DataLoader(_data(5), batch_size=1, shuffle=True))
    assert torch.equal(torch.cat([b[0] for b in Accelerator().skip_first_batches(fresh, 2)]), epoch0[2:])
    assert torch.equal(torch.cat([b[0] for b in fresh]), epoch1)  # later epochs are whole again
    plain = DataLoader(_data(5), batch_size=1)
    assert len(list(accelerator.skip_first_batches(plain, 3))) == 2
    with pytest.raises(ValueError, match="num_batches"):
        accelerator.skip_first_batches(loader, -1)


def test_data_seed_and_set_seed_choose_the_shuffle():
    def order(**kwargs):
        loader = Accelerator(**kwargs).prepare(DataLoader(_data(8), batch_size=1, shuffle=True))
        return [b[0] for b in loader]

    set_seed(11)
    by_set_seed = order()
    assert [torch.equal(a, b) for a, b in zip(by_set_seed, order())] == [True] * 8
    other = order(dataloader_config=DataLoaderConfiguration(data_seed=12))
    assert not all(torch.equal(a, b) for a, b in zip(by_set_seed, other))


# ---- clipping, models, memory ------------------------------------------------------------------------------

def test_clip_grad_norm_is_the_strategys_norm_and_clip_value_clamps():
    accelerator = Accelerator()
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = next(iter(DataLoader(_data(4), batch_size=4)))
    accelerator.backward(_loss(model, batch) * 50)
    (_loss(reference, batch) * 50).backward()
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert max(p.grad.abs().max() for p in model.parameters()) <= 0.01


def test_unwrap_model_can_drop_the_autocast_and_free_memory_drops_every_reference():
    accelerator = Accelerator(mixed_precision="bf16")  # the TPU page's line
    assert isinstance(accelerator.runner.precision, BF16) and accelerator.mixed_precision == "bf16"
    model = accelerator.prepare(_model())
    x = torch.randn(2, 3)
    assert model(x).dtype == torch.bfloat16
    with accelerator.autocast():
        assert torch.mm(x, x.T).dtype == torch.bfloat16
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(x).dtype == torch.float32
    alive = weakref.ref(plain)
    del model, plain
    assert accelerator.free_memory() == []
    gc.collect()
    assert alive() is None and accelerator.runner._module is None


def test_process_helpers_and_handlers_of_one_process(tmp_path, monkeypatch):
    from datetime import timedelta

    monkeypatch.delenv("SHARDKIT_COLLECTIVE_TIMEOUT", raising=False)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=123))])
    assert accelerator.device == torch.device("cpu") and accelerator.distributed_type == "NO"
    import os

    assert os.environ["SHARDKIT_COLLECTIVE_TIMEOUT"] == "123.0"  # bounds every collective of the job
    assert (accelerator.is_main_process, accelerator.is_local_main_process, accelerator.is_last_process,
            accelerator.process_index, accelerator.local_process_index, accelerator.num_processes) == \
        (True, True, True, 0, 0, 1)
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        accelerator.wait_for_everyone()
    assert accelerator.on_main_process(lambda: 1)() == 1 and accelerator.on_process(process_index=1)(lambda: 1)() \
        is None
    with accelerator.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    accelerator.save({"a": torch.ones(2)}, tmp_path / "obj.pt")
    assert torch.equal(torch.load(tmp_path / "obj.pt")["a"], torch.ones(2))
    assert accelerator.gather(torch.tensor(3.0)).tolist() == [3.0] and accelerator.reduce(torch.ones(2)).tolist() \
        == [1.0, 1.0]


# ---- trackers ----------------------------------------------------------------------------------------------

def test_trackers_write_what_their_readers_read(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(log_with=["jsonl", "tensorboard"], project_dir=str(tmp_path))
    accelerator.init_trackers("run", config={"lr": 0.1, "note": "x"})
    accelerator.log({"loss": 1.5, "acc": torch.tensor(0.25), "bad": math.nan}, step=3)
    assert type(accelerator.get_tracker("tensorboard", unwrap=True)).__name__ == "SummaryWriter"
    accelerator.end_training()
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert lines[0]["config"] == {"lr": 0.1, "note": "x"}
    assert {k: lines[1][k] for k in ("step", "loss", "acc", "bad")} == {"step": 3, "loss": 1.5, "acc": 0.25,
                                                                         "bad": "nan"}
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 1.5)]


def test_unknown_trackers_and_missing_directories_are_named():
    assert "tensorboard" in TRACKERS.names() and "jsonl" in TRACKERS.names()
    with pytest.raises(ValueError, match="unknown tracker 'tensorbord'; did you mean 'tensorboard'"):
        Accelerator(log_with="tensorbord", project_dir=".")
    with pytest.raises(ValueError, match="project_dir"):
        Accelerator(log_with="jsonl")


# ---- constructor keywords and plugins ----------------------------------------------------------------------

def test_plugins_and_handlers_map_onto_strategy_and_precision(tmp_path):
    ds = deepspeed_config({"zero_stage": 3, "offload_optimizer_device": "cpu", "gradient_clipping": 1.0}, "bf16")
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert ds["gradient_clipping"] == 1.0 and ds["bf16"] == {"enabled": True}
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert deepspeed_config({"hf_ds_config": str(tmp_path / "ds.json")}, "no") == {"zero_optimization": {"stage": 1}}
    assert deepspeed_config({"zero_optimization": {"stage": 2}}, "no") == {"zero_optimization": {"stage": 2}}
    fsdp = fsdp_strategy({"sharding_strategy": "SHARD_GRAD_OP", "cpu_offload": True,
                          "transformer_cls_names_to_wrap": ["Block"], "state_dict_type": "FULL_STATE_DICT"})
    assert (fsdp.settings.sharding, fsdp.settings.cpu_offload, fsdp.settings.auto_wrap,
            fsdp.settings.state_dict_type) == ("grad_op", True, ("Block",), "full")
    scaled = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024,
                                                                                  growth_interval=10)])
    assert scaled.runner.precision.initial_scale_power == 10 and scaled.runner.precision.loss_scale_window == 10
    with pytest.raises(NotImplementedError, match="broadcast_buffers"):
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    with pytest.raises(NotImplementedError, match="backend='mpi'"):
        Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="mpi")])


def test_accelerates_own_plugin_objects_are_read_by_attribute():
    utils = pytest.importorskip("accelerate.utils")
    ds = deepspeed_config(utils.DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=4), "no")
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert "steps_per_print" not in ds  # Accelerate writes inf: "never"
    fsdp = fsdp_strategy(utils.FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False))
    assert fsdp.settings.reshard_after_forward is False
    handler = utils.DistributedDataParallelKwargs(find_unused_parameters=True)
    accelerator = Accelerator(kwargs_handlers=[handler, utils.GradientAccumulationPlugin(num_steps=3)])
    assert accelerator.gradient_accumulation_steps == 3 and accelerator.runner.gradient_accumulation_steps == 3


@pytest.mark.parametrize("kwargs,error,text", [
    ({"mixed_precision": "fp8"}, NotImplementedError, "fp8"),
    ({"mixed_precision": "bf17"}, ValueError, "did you mean 'bf16'"),
    ({"gradient_acumulation_steps": 2}, TypeError, "did you mean 'gradient_accumulation_steps'"),
    ({"device_placement": False}, NotImplementedError, "device_placement"),
    ({"dynamo_backend": "inductor"}, NotImplementedError, "torch.compile"),
    ({"deepspeed_plugin": {"zero_stage": 2}, "fsdp_plugin": {}}, ValueError, "pass one"),
    ({"fsdp_plugin": {"mixed_precision_policy": "bf16"}}, NotImplementedError, "mixed_precision"),
])
def test_what_cannot_be_honoured_is_refused_by_name(kwargs, error, text):
    with pytest.raises(error, match=text):
        Accelerator(**kwargs)


def test_methods_forwarded_to_the_parts_keep_accelerates_signatures_and_state():
    """The Accelerator forwards Accelerate's methods to its parts (training, checkpoints, tracking): each keeps
    Accelerate's parameter names, and state set through the Accelerator is the part's (one owner, no copy)."""
    import inspect

    accelerate = pytest.importorskip("accelerate")
    forwarded = ["backward", "accumulate", "no_sync", "unscale_gradients", "clip_grad_norm_", "clip_grad_value_",
                 "gather", "reduce", "pad_across_processes", "gather_for_metrics", "set_trigger", "check_trigger",
                 "join_uneven_inputs", "autocast", "register_for_checkpointing", "save_state", "load_state",
                 "skip_first_batches", "get_state_dict", "save_model", "save", "get_tracker", "end_training"]
    for name in forwarded:
        ours = list(inspect.signature(getattr(Accelerator, name)).parameters)
        theirs = list(inspect.signature(getattr(accelerate.Accelerator, name)).parameters)
        assert ours == theirs, name
        assert getattr(Accelerator, name).__doc__, name
    accelerator = Accelerator(gradient_accumulation_steps=2)
    net = _model()
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(3):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 3)).sum())
            optimizer.step()
            optimizer.zero_grad()
    assert accelerator.step == accelerator.training.step == 3
    assert accelerator.runner.optimizer_steps == 1
    accelerator.step = 7
    assert accelerator.training.step == 7
    assert accelerator.prepared.models == [model] and accelerator.prepared.owner_of(optimizer) is model
