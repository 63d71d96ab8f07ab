"""Optimizers that update inside backward, through the Trainer: LOMO, AdaLomo, layer-wise GaLore.

Each row trains a tiny Llama (loss falls) and resumes exactly; LOMO equals SGD and layer-wise GaLore equals
GaLore stepped once per window (so the schedule's lr reaches the updates); our AdaLomo equals lomo-optim's
(its own code, run on the CPU with ``Tensor.cuda`` patched to the identity); the settings they cannot run
with are refused by name.
"""

import importlib
import sys

import pytest
import torch
from torch import nn
from trainer_fixtures import StopAt, logged_losses, text_data

from shardkit.models import Llama, LlamaConfig
from shardkit.optim import AdaLomo, LayerwiseOptimizer, MissingOptimizerPackage, OptimizerUnsupportedError
from shardkit.optim import create_optimizer as by_name
from shardkit.trainer import Trainer, TrainingArguments
from shardkit.trainer.backward_step import BackwardStepError

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)
GALORE = dict(optim_target_modules=["q_proj", "v_proj", "up_proj"],
              optim_args={"rank": 4, "update_proj_gap": 4, "scale": 0.5})
ROWS = {
    "lomo": dict(optim="lomo", learning_rate=0.2),
    "adalomo": dict(optim="adalomo", learning_rate=0.05),
    "galore_adamw_layerwise": dict(optim="galore_adamw_layerwise", learning_rate=1e-2, **GALORE),
    "galore_adafactor_layerwise": dict(optim="galore_adafactor_layerwise", learning_rate=1e-2, **GALORE),
}


def _data(n=48):
    return text_data(n)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=8, logging_steps=1,
                save_strategy="no", disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=1, seed=0,
                weight_decay=0.01, max_grad_norm=0.0)
    return TrainingArguments(**{**base, **kw})


def _llama(fused=True):
    torch.manual_seed(1)
    return Llama(LlamaConfig(**{**TINY.__dict__, "fused": fused}))


def _train(tmp_path, fused=True, **kw):
    trainer = Trainer(_llama(fused), _args(tmp_path, **kw), train_dataset=_data())
    trainer.train()
    return trainer


@pytest.mark.parametrize("row", sorted(ROWS))
def test_row_trains_and_resumes_exactly(tmp_path, row):
    full = _train(tmp_path / "full", max_steps=6, **ROWS[row])
    losses = logged_losses(full)
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.1, losses  # the loss falls
    first = Trainer(_llama(), _args(tmp_path / "cut", max_steps=6, save_strategy="steps", save_steps=3, **ROWS[row]),
                    train_dataset=_data(), callbacks=[StopAt(3)])
    first.train()
    torch.manual_seed(123)  # the resumed process starts from other RNG states and fresh weights
    second = Trainer(_llama(), _args(tmp_path / "cut", max_steps=6, save_strategy="steps", save_steps=3,
                                     **ROWS[row]), train_dataset=_data())
    second.train(resume_from_checkpoint=True)
    assert logged_losses(second) == losses
    for (name, a), b in zip(second.model.named_parameters(), full.model.parameters()):
        assert torch.equal(a, b), name
    if row == "adalomo":
        assert second.optimizer.state and second.optimizer.param_groups[0]["step"] == 6


def test_lomo_is_sgd_with_the_schedules_lr_and_clipping(tmp_path):
    kw = dict(learning_rate=0.2, weight_decay=0.0, max_grad_norm=0.5, max_steps=4)
    # fused=False: the clipping norm is measured by a first backward that keeps the graph, which
    # shardkit's fused cross-entropy refuses (test_clipping_with_a_loss_that_cannot_backward_twice...).
    lomo = _train(tmp_path / "lomo", fused=False, optim="lomo", **kw)
    sgd = _train(tmp_path / "sgd", fused=False, optim="sgd", **kw)
    assert logged_losses(lomo) == pytest.approx(logged_losses(sgd), rel=1e-6)
    for (name, a), b in zip(lomo.model.named_parameters(), sgd.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    norms = [h["grad_norm"] for h in lomo.state.log_history if "grad_norm" in h]
    assert len(norms) == 4 and all(n > 0 for n in norms)  # the package's grad_norm pass, logged
    assert lomo.runner.optimizer_steps == 4


def test_layerwise_galore_equals_galore_stepped_per_window(tmp_path):
    layerwise = _train(tmp_path / "lw", max_steps=4, max_grad_norm=0.0, **ROWS["galore_adamw_layerwise"])
    whole = _train(tmp_path / "whole", max_steps=4, max_grad_norm=0.0,
                   **{**ROWS["galore_adamw_layerwise"], "optim": "galore_adamw"})
    for (name, a), b in zip(layerwise.model.named_parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    opt = layerwise.optimizer
    assert isinstance(opt, LayerwiseOptimizer) and len(opt.optimizers) == len(list(layerwise.model.parameters()))
    lr = layerwise.lr_scheduler.get_last_lr()[0]
    assert lr != 1e-2 and all(o.param_groups[0]["lr"] == lr for o in opt.optimizers)  # one schedule for all
    assert sum("rank" in o.param_groups[0] for o in opt.optimizers) == 6  # q, v, up in 2 layers


# ---- AdaLomo: ours against lomo-optim's own code --------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 16)

    def forward(self, ids):
        return self.out(torch.tanh(self.norm(self.emb(ids))))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 16, (4, 6), generator=g)
    return nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, 16), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("clip", [None, 0.3])
def test_our_adalomo_equals_lomo_optims(monkeypatch, clip):
    package = importlib.import_module("lomo_optim")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # its state, left on the CPU
    theirs_model, ours_model = Tiny(), Tiny()
    kw = dict(lr=0.05, weight_decay=0.1, clip_grad_norm=clip, clip_grad_value=0.5)
    theirs = package.AdaLomo(theirs_model, **kw)
    ours = AdaLomo(ours_model.parameters(), **kw)
    for step, lr in enumerate([0.05, 0.03, 0.02]):
        for model, opt in ((theirs_model, theirs), (ours_model, ours)):
            if clip:
                opt.grad_norm(_loss(model, step))
            opt.fused_backward(_loss(model, step), lr)
        for (name, a), b in zip(theirs_model.named_parameters(), ours_model.parameters()):
            assert torch.equal(a, b), (step, name)
    assert all(p.grad is None for p in ours_model.parameters())
    for name, p in ours_model.named_parameters():
        key = "exp_avg_sq_row" if p.dim() > 1 else "exp_avg_sq"
        assert torch.equal(ours.state[p][key], getattr(theirs, key)[name]), name


# ---- refusals and missing packages ---------------------------------------------------------------------


@pytest.mark.parametrize("row", ["lomo", "adalomo", "galore_adamw_layerwise"])
def test_gradient_accumulation_is_refused_by_name(tmp_path, row):
    trainer = Trainer(_llama(), _args(tmp_path, gradient_accumulation_steps=2, **ROWS[row]), train_dataset=_data())
    with pytest.raises(BackwardStepError, match="gradient_accumulation_steps=2 is not supported"):
        trainer.train()


def test_clipping_with_a_loss_that_cannot_backward_twice_says_what_to_do(tmp_path):
    trainer = Trainer(_llama(), _args(tmp_path, max_grad_norm=1.0, **ROWS["adalomo"]), train_dataset=_data())
    with pytest.raises(BackwardStepError, match="max_grad_norm=0"):
        trainer.train()


def test_fp16_is_refused_by_name(tmp_path):
    trainer = Trainer(_llama(), _args(tmp_path, fp16=True, **ROWS["adalomo"]), train_dataset=_data())
    with pytest.raises(BackwardStepError, match="FP16"):
        trainer.train()


def test_galore_adamw_8bit_layerwise_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the 8-bit row builds")
    model = _llama()
    with pytest.raises(OptimizerUnsupportedError, match="CUDA GPU"):
        by_name("galore_adamw_8bit_layerwise", model.parameters(), lr=1e-3,
                context={"model": model, "optim_target_modules": "all-linear"})


@pytest.mark.parametrize(("optim", "module", "package"), [("lomo", "lomo_optim", "lomo-optim"),
                                                         ("galore_adamw_layerwise", "galore_torch", "galore-torch")])
def test_missing_package_names_it_and_the_extra(monkeypatch, optim, module, package):
    from shardkit.optim.lomo import lomo_class

    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as when not installed
    lomo_class.cache_clear()
    model = _llama()
    try:
        with pytest.raises(MissingOptimizerPackage, match=rf"'{package}'.*pip install shardkit\[optimizers\]"):
            by_name(optim, model.parameters(), lr=1e-3, context={"model": model, "optim_target_modules": "all-linear"})
    finally:
        lomo_class.cache_clear()
