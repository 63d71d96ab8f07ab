"""DeepSpeed universal checkpoints in and out, against DeepSpeed 0.19.8's own engine (2 CPU ranks) and its own
``ds_to_universal``: a ZeRO-2 and a ZeRO-3 run converted by DeepSpeed resume in shardkit on one rank with the
uninterrupted run's losses, and a shardkit run written as universal resumes in DeepSpeed's engine with shardkit's
own continuing losses. One launch holds every DeepSpeed part; the shardkit parts run in this process."""

import argparse
import os

import pytest
import torch
from harness import run_distributed
from torch import nn

import shardkit
from shardkit.checkpoint.ds_universal import is_universal_checkpoint, shardkit_to_universal, universal_to_shardkit

ENV = {"DS_ACCELERATOR": "cpu"}
SAVE_AT, STEPS = 3, 5  # the checkpoint holds 3 optimizer steps; the next 2 are compared
LR, DECAY = 0.01, 0.1


class Tiny(nn.Module):
    """Odd sizes (ZeRO pads them on 2 ranks), two param groups with different weight decay, a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(13, 10)
        self.norm = nn.LayerNorm(10)
        self.proj = nn.Linear(10, 7)
        self.head = nn.Linear(7, 13, bias=False)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, ids):
        return self.head(self.proj(self.norm(self.embed(ids)))) * self.scale[0]


def _optimizer(model, decay_rest=0.0, one_group=False):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    if one_group:
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    # a learning rate the checkpoint must override: the saved groups' hyperparameters are restored
    return torch.optim.AdamW([{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": decay_rest}],
                             lr=LR if decay_rest == 0.0 else 0.5)


def _batch(step):
    return torch.randint(0, 13, (4, 5), generator=torch.Generator().manual_seed(step))


def _engine(stage, load_universal=False, one_group=False):
    import deepspeed

    torch.manual_seed(0)
    model = Tiny()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "checkpoint": {"load_universal": load_universal}}
    model.universal_checkpoint_info = {"universal_checkpoint_version": 0.4}  # ds_to_universal asks ZeRO-1/2 for it
    engine, *_ = deepspeed.initialize(model=model, optimizer=_optimizer(model, one_group=one_group),
                                       config=cfg)
    return engine


def _ds_steps(engine, steps):
    """Each rank takes its half of the global batch; returns the global loss (mean over ranks) of each step."""
    import torch.distributed as dist

    rank, losses = dist.get_rank(), []
    for step in steps:
        loss = engine(_batch(step)[2 * rank: 2 * rank + 2]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / 2)
    return losses


def _deepspeed_runs(root):
    """Rank worker: ZeRO-2 and ZeRO-3 runs saved after SAVE_AT steps and run on (DeepSpeed's ds_to_universal
    converts the saves), then the universal checkpoint shardkit wrote resumed by the engine at both stages."""
    import torch.distributed as dist
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    from shardkit.distributed.process_group import init_distributed

    init_distributed("cpu")
    out = {"uninterrupted": {}, "resumed": {}}
    for stage in (2, 3):
        engine = _engine(stage)
        losses = _ds_steps(engine, range(SAVE_AT))
        engine.save_checkpoint(f"{root}/z{stage}")
        out["uninterrupted"][stage] = losses + _ds_steps(engine, range(SAVE_AT, STEPS))
        dist.barrier()
        if dist.get_rank() == 0:
            tag = f"{root}/z{stage}/global_step{SAVE_AT}"
            ds_to_universal(argparse.Namespace(input_folder=tag, output_folder=f"{tag}_universal", strict=True,
                                               num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                               inject_missing_state=False))
        dist.barrier()
    for stage in (2, 3):
        # DeepSpeed's ZeRO-3 universal load gives every param group the first group's hyperparameters and one step
        # tensor that each group's Adam then advances: with one group it resumes exactly
        engine = _engine(stage, load_universal=True, one_group=stage == 3)
        engine.load_checkpoint(f"{root}/from_shardkit")
        losses = _ds_steps(engine, range(SAVE_AT, STEPS))
        out["resumed"][stage] = (engine.global_steps, losses)
    return out


def _shardkit_steps(runner, model, steps):
    losses = []
    for step in steps:
        loss = model(_batch(step)).pow(2).mean()
        runner.backward(loss)
        runner.step()
        losses.append(loss.item())
    return losses


def _resume(path, strategy="single", zero3_groups=False):
    """A fresh shardkit run loaded from ``path``; its next steps' losses (optionally with every group given group
    0's hyperparameters, as DeepSpeed's ZeRO-3 universal load does)."""
    torch.manual_seed(1)  # other initial weights: only the load can make the losses match
    runner = shardkit.Runner(strategy=strategy, precision="fp32")
    model = Tiny()
    model, opt = runner.setup(model, _optimizer(model, decay_rest=0.5))
    runner.load(path, {"model": model, "optimizer": opt})
    assert runner.optimizer_steps == SAVE_AT and [g["lr"] for g in opt.param_groups] == [LR, LR]
    if zero3_groups:
        opt.param_groups[1]["weight_decay"] = opt.param_groups[0]["weight_decay"]
    return _shardkit_steps(runner, model, range(SAVE_AT, STEPS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("universal")
    torch.manual_seed(0)
    runner = shardkit.Runner(strategy="single", precision="fp32")
    model = Tiny()
    model, opt = runner.setup(model, _optimizer(model))
    _shardkit_steps(runner, model, range(SAVE_AT))
    runner.save(root / "sk" / f"step-{SAVE_AT}", {"model": model, "optimizer": opt})
    shardkit_to_universal(root / "sk", root / "from_shardkit" / f"global_step{SAVE_AT}_universal")
    assert is_universal_checkpoint(root / "from_shardkit")
    continuing = _shardkit_steps(runner, model, range(SAVE_AT, STEPS))
    ds = run_distributed(_deepspeed_runs, world_size=2, timeout=900, args=(str(root),), env=ENV)[0]
    return root, continuing, ds


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_deepspeed_universal_resumes_in_shardkit(runs, tmp_path, stage, strategy):
    root, _, ds = runs
    src = root / f"z{stage}"
    assert is_universal_checkpoint(src) and not is_universal_checkpoint(src / f"global_step{SAVE_AT}")
    universal_to_shardkit(src, tmp_path / "ckpt", progress=lambda done, total: None)
    got = _resume(tmp_path / "ckpt", strategy)
    torch.testing.assert_close(got, ds["uninterrupted"][stage][SAVE_AT:], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stage", [2, 3])
def test_shardkit_written_universal_resumes_in_deepspeed(runs, stage):
    root, continuing, ds = runs
    global_steps, losses = ds["resumed"][stage]
    assert global_steps == STEPS
    # The ZeRO-3 engine resumes with one group (see _deepspeed_runs), so with the first group's hyperparameters for
    # every parameter: shardkit continuing under that rule is what it must match, moments and step included.
    want = continuing if stage == 2 else _resume(root / "sk", zero3_groups=True)
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-7)


def test_deepspeed_engine_order_is_the_uninterrupted_one(runs):
    """The reference itself: both ZeRO stages trained the same run, so a mismatch above is the conversion's."""
    _, continuing, ds = runs
    torch.testing.assert_close(ds["uninterrupted"][2], ds["uninterrupted"][3], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ds["uninterrupted"][2][SAVE_AT:], continuing, rtol=1e-5, atol=1e-7)
    assert os.path.isdir(runs[0] / "z2" / f"global_step{SAVE_AT}_universal" / "zero")
