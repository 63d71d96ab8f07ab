"""Optimizers by name through the Trainer (issue 14): every row trains, saves and resumes exactly (or says
why not), GaLore's targets, schedule-free's averaged weights in eval and saves, GrokAdamW's loss, and the
errors for a missing package."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import Subset

from shardkit.models import ByteTextDataset, Llama, LlamaConfig
from shardkit.optim import GaLoreTargetError, MissingOptimizerPackage, OptimizerUnsupportedError, create_optimizer
from shardkit.optim.named import galore_target_parameters, parse_optim_args
from shardkit.trainer import Trainer, TrainerCallback, TrainingArguments
from shardkit.trainer.optim_modes import check_optimizer_strategy

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_position=16)

# name -> (learning rate, optim_args): each trains the tiny Llama in 8 steps
ROWS = {
    "adamw_torch": (1e-2, {}), "adamw_torch_fused": (1e-2, {}), "adamw_shardkit": (1e-2, {}),
    "sgd": (0.5, {"momentum": 0.9}), "adafactor": (0.1, {}),
    "galore_adamw": (1e-2, "rank=4,update_proj_gap=3,scale=1.0"),
    "galore_adafactor": (1e-2, {"rank": 4, "update_proj_gap": 3, "scale": 1.0, "proj_type": "left"}),
    "grokadamw": (1e-2, {}), "schedule_free_adamw": (1e-2, {}), "schedule_free_sgd": (0.5, {}),
    "schedule_free_radam": (5e-2, {"silent_sgd_phase": False}),
}


def _data(n=64):
    return Subset(ByteTextDataset(TEXT, seq_len=16, stride=16), range(n))


def _llama():
    torch.manual_seed(1)
    return Llama(TINY)


def _args(out, name, **kw):
    lr, optim_args = ROWS[name]
    base = dict(output_dir=str(out), per_device_train_batch_size=8, learning_rate=lr, max_steps=8,
                logging_steps=1, save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant", seed=0,
                optim=name, optim_args=optim_args, optim_target_modules="all-linear" if "galore" in name else None)
    return TrainingArguments(**{**base, **kw})


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_row_trains_and_resumes_exactly(tmp_path, name):
    args = dict(save_strategy="steps", save_steps=4)
    full = Trainer(_llama(), _args(tmp_path / "full", name, **args), train_dataset=_data())
    full.train()
    losses = _losses(full)
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.2, losses  # the loss falls
    torch.manual_seed(99)  # the resumed process starts with other RNG states
    resumed = Trainer(_llama(), _args(tmp_path / "full", name, **args), train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-4"))
    assert _losses(resumed)[4:] == losses[4:]
    for (pname, a), b in zip(resumed.model.named_parameters(), full.model.parameters()):
        assert torch.equal(a, b), pname


class _KeepY(TrainerCallback):
    """The model's weights right after each optimizer step: schedule-free's y (the point gradients are taken at)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.y = {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["schedule_free_adamw", "schedule_free_sgd"])
def test_schedule_free_evaluates_and_saves_the_average(tmp_path, name):
    keep = _KeepY()
    trainer = Trainer(_llama(), _args(tmp_path, name, max_steps=5, save_strategy="steps", save_steps=5),
                      train_dataset=_data(), eval_dataset=_data(16), callbacks=[keep])
    trainer.train()
    optimizer = trainer.optimizer
    beta1 = optimizer.param_groups[0]["betas"][0] if "betas" in optimizer.param_groups[0] else \
        optimizer.param_groups[0]["momentum"]
    params = dict(trainer.model.named_parameters())
    expected = {}
    for n, p in params.items():  # x = y + (1 - 1/beta1) (z - y), the average the optimizer keeps implicitly
        z = optimizer.state[p]["z"]
        expected[n] = keep.y[n] + (1 - 1 / beta1) * (z - keep.y[n])
        assert not torch.allclose(expected[n], keep.y[n]), n  # x and y differ: the test can fail
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-5, atol=1e-6)
    saved = load_file(str(tmp_path / "checkpoint-5" / "model.safetensors")) if \
        (tmp_path / "checkpoint-5" / "model.safetensors").is_file() else None
    trainer.save_model(str(tmp_path / "export"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))  # as transformers' LlamaForCausalLM
    hf_name = trainer.model.hf_export().hf_name
    for n in params:
        assert torch.equal(exported[hf_name(n)], params[n].detach()), n
        if saved is not None and n in saved:
            assert torch.equal(saved[n], params[n].detach()), n
    first = trainer.evaluate()["eval_loss"]
    assert trainer.evaluate()["eval_loss"] == first  # evaluating twice does not swap back and forth
    assert all(not g["train_mode"] for g in optimizer.param_groups)


def test_grokadamw_gets_the_training_and_eval_loss(tmp_path):
    seen = []

    class Spy(TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            seen.append(optimizer.param_groups[0].get("train_loss"))

    trainer = Trainer(_llama(), _args(tmp_path, "grokadamw", max_steps=4, eval_strategy="steps", eval_steps=2),
                      train_dataset=_data(), eval_dataset=_data(8), callbacks=[Spy()])
    trainer.train()
    assert seen == pytest.approx(_losses(trainer), rel=1e-6)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert trainer.optimizer.param_groups[0]["eval_loss"] == pytest.approx(evals[-1])


def test_galore_targets_and_errors():
    model = _llama()
    linear = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    everything = galore_target_parameters(model, "all-linear")  # every Linear, lm_head included (as HF)
    assert {id(p) for p in everything} == {id(p) for p in linear}
    by_regex = galore_target_parameters(model, r".*\.(q|k)_proj")
    by_list = galore_target_parameters(model, ["q_proj", "k_proj"])
    by_text = galore_target_parameters(model, "q_proj,k_proj")  # as --optim_target_modules q_proj,k_proj gives it
    assert len(by_regex) == len(by_list) == len(by_text) == 2 * TINY.num_layers
    with pytest.raises(GaLoreTargetError, match="matched no nn.Linear"):
        galore_target_parameters(model, ["no_such_layer"])
    with pytest.raises(GaLoreTargetError, match="only non-Linear modules: embed_tokens .Embedding"):
        galore_target_parameters(model, ["embed_tokens"])
    with pytest.raises(GaLoreTargetError, match="needs TrainingArguments.optim_target_modules"):
        create_optimizer("galore_adamw", model.parameters(), context={"model": model, "optim_target_modules": None})
    with pytest.raises(OptimizerUnsupportedError, match="CUDA"):
        create_optimizer("galore_adamw_8bit", model.parameters(), context={"model": model,
                                                                         "optim_target_modules": "all-linear"})
    assert parse_optim_args("rank=64, update_proj_gap=200,scale=0.25,proj_type=std") == \
        {"rank": 64, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
    assert TrainingArguments(optim_args='{"rank": 8}').optim_args == {"rank": 8}
    with pytest.raises(TypeError, match="'adamw_torch' does not take one of.*optim_args"):
        create_optimizer("adamw_torch", model.parameters(), rank=8)


def test_impossible_strategy_combinations_are_refused_by_name():
    from shardkit.strategies.fsdp import FSDP
    from shardkit.strategies.zero import ZeRO2

    model = _llama()
    context = {"model": model, "optim_target_modules": "all-linear"}
    refused = {"galore_adamw": (ZeRO2(), FSDP()), "grokadamw": (ZeRO2(),), "adafactor": (FSDP(),)}
    for name, strategies in refused.items():
        optimizer = create_optimizer(name, model.parameters(), context=context, lr=1e-3)
        for strategy in strategies:  # built, not set up: no process group needed
            with pytest.raises(OptimizerUnsupportedError, match=f"under {type(strategy).__name__}"):
                check_optimizer_strategy(optimizer, strategy)
    # these run there (tests/distributed: test_named_optimizers_distributed.py, test_fused_adamw_sharded.py)
    check_optimizer_strategy(create_optimizer("grokadamw", model.parameters()), FSDP())
    check_optimizer_strategy(create_optimizer("adamw_shardkit", model.parameters()), FSDP())


@pytest.mark.parametrize("name,module,package", [("galore_adamw", "galore_torch", "galore-torch"),
                                                 ("grokadamw", "grokadamw", "grokadamw"),
                                                 ("schedule_free_adamw", "schedulefree", "schedulefree")])
def test_a_missing_package_names_itself_and_the_extra(monkeypatch, name, module, package):
    for key in [k for k in sys.modules if k.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like to import
    model = _llama()
    with pytest.raises(MissingOptimizerPackage, match=rf"'{package}'.*pip install shardkit\[optimizers\]"):
        create_optimizer(name, model.parameters(), context={"model": model, "optim_target_modules": "all-linear"})
