"""Activation checkpointing on one process: settings and kwargs checked by name, one patch per block (the Runner's
switch and FSDP's share it), reentrant refusals, the DeepSpeed section's mapping and warnings, the Runner's
precedence between its argument and a config, and the Trainer's ``gradient_checkpointing(_kwargs)`` for
shardkit's Llama (the Runner's switch, an exact step) and a Hugging Face Llama (its own checkpointing).
Every strategy on 2 ranks: tests/distributed/test_activation_checkpointing_distributed.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Subset

from shardkit import Runner, SingleDevice
from shardkit.config import ConfigError, common, resolve_runner_config
from shardkit.models import ByteTextDataset, Llama, LlamaBlock, LlamaConfig
from shardkit.strategies.activation_checkpointing import (
    ActivationCheckpointing,
    ActivationCheckpointingError,
    apply_activation_checkpointing,
    checkpointed_modules,
    parse_checkpoint_kwargs,
)
from shardkit.strategies.fsdp import FSDPSettings
from shardkit.trainer import Trainer, TrainingArguments

TEXT = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16, dropout=0.1)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(common, "_WARNED", set())


def _llama() -> Llama:
    torch.manual_seed(1)
    return Llama(TINY)


def _count_mlp_calls(model: nn.Module) -> list[int]:
    calls = [0]
    model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


# ---- settings ---------------------------------------------------------------------------------------------


def test_settings_and_kwargs_are_checked_by_name():
    assert parse_checkpoint_kwargs('{"use_reentrant": true, "preserve_rng_state": false}') == {
        "use_reentrant": True, "preserve_rng_state": False}
    with pytest.raises(ActivationCheckpointingError, match=r"'use_reentrat'.*did you mean 'use_reentrant'"):
        parse_checkpoint_kwargs({"use_reentrat": True})
    with pytest.raises(ActivationCheckpointingError, match="not valid JSON"):
        parse_checkpoint_kwargs("{use_reentrant: true}")
    with pytest.raises(ActivationCheckpointingError, match="use_reentrant='no' must be true or false"):
        parse_checkpoint_kwargs({"use_reentrant": "no"})
    with pytest.raises(ActivationCheckpointingError, match="blocks=3"):
        ActivationCheckpointing(blocks=3)
    with pytest.raises(ActivationCheckpointingError, match="offload_to_cpu=1 must be True or False"):
        ActivationCheckpointing(offload_to_cpu=1)
    args = TrainingArguments(output_dir="/tmp/unused", gradient_checkpointing=True,
                             gradient_checkpointing_kwargs='{"use_reentrant": true}')
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": True}
    with pytest.raises(ValueError, match="TrainingArguments.gradient_checkpointing_kwargs: 'reentrant'"):
        TrainingArguments(output_dir="/tmp/unused", gradient_checkpointing_kwargs={"reentrant": True})
    assert FSDPSettings(activation_checkpointing=ActivationCheckpointing(use_reentrant=True))  # the same settings


# ---- the patch --------------------------------------------------------------------------------------------


def test_one_patch_per_block_shared_by_runner_and_strategy():
    model = _llama()
    assert len(apply_activation_checkpointing(model, ActivationCheckpointing())) == TINY.num_layers
    # FSDP naming the same blocks with the same options (its auto-wrap classes) leaves them as they are.
    same = ActivationCheckpointing(LlamaBlock)
    assert apply_activation_checkpointing(model, same, default_blocks=(LlamaBlock,)) == []
    assert checkpointed_modules(model) == list(model.layers)
    with pytest.raises(ActivationCheckpointingError, match="already checkpointed.*set activation checkpointing in "
                                                           "one place"):
        apply_activation_checkpointing(model, ActivationCheckpointing(use_reentrant=True), owner="FSDP ac")
    with pytest.raises(ValueError, match=r"no module of class 'LlamaBlok'.*did you mean 'LlamaBlock'"):
        apply_activation_checkpointing(_llama(), ActivationCheckpointing("LlamaBlok"))
    with pytest.raises(ActivationCheckpointingError, match="found no repeated block.*name the block class"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)), ActivationCheckpointing())
    assert checkpointed_modules(model)[0].state_dict().keys() == LlamaBlock(TINY).state_dict().keys()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_step_is_bitwise_the_same_and_the_block_is_recomputed(use_reentrant):
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for settings in (None, ActivationCheckpointing(use_reentrant=use_reentrant)):
        model = _llama()
        apply_activation_checkpointing(model, settings)
        calls = _count_mlp_calls(model)
        torch.manual_seed(3)  # dropout 0.1: the recompute must replay the forward's masks
        model(x, labels=x).backward()
        results.append((calls[0], [p.grad.clone() for p in model.parameters()]))
        with torch.no_grad():  # eval: no recompute, no checkpoint machinery
            calls[0] = 0
            model(x)
            assert calls[0] == 1
    (off_calls, off_grads), (on_calls, on_grads) = results
    assert (off_calls, on_calls) == (1, 2)
    assert all(torch.equal(a, b) for a, b in zip(off_grads, on_grads))


def test_reentrant_refuses_what_would_lose_gradients():
    model = _llama()
    apply_activation_checkpointing(model, ActivationCheckpointing(use_reentrant=True))
    model.embed_tokens.weight.requires_grad_(False)  # frozen embeddings (LoRA): no input of block 0 needs grad
    x = torch.randint(0, 256, (1, 8))
    with pytest.raises(ActivationCheckpointingError, match="no positional input of LlamaBlock requires grad"):
        model(x, labels=x)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    blocks = nn.ModuleList([Block()])
    apply_activation_checkpointing(blocks, ActivationCheckpointing(use_reentrant=True))
    with pytest.raises(ActivationCheckpointingError, match=r"gets \['scale'\] by keyword"):
        blocks[0](torch.ones(1, 4, requires_grad=True), scale=torch.ones(1, requires_grad=True))


# ---- DeepSpeed section and the Runner ---------------------------------------------------------------------


def test_deepspeed_section_maps_and_warns_by_name(caplog):
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": False}
    with caplog.at_level(logging.WARNING, logger="shardkit.config"):
        resolved = resolve_runner_config({"activation_checkpointing": section})
    ac = resolved.activation_checkpointing
    assert (ac.blocks, ac.offload_to_cpu, ac.synchronize, ac.use_reentrant, dict(ac.deepspeed)) == (
        True, True, True, False, section)
    warned = [r.getMessage() for r in caplog.records]
    for key in ("partition_activations=True", "number_checkpoints=4"):
        assert sum(f"activation_checkpointing.{key} has no effect" in m for m in warned) == 1, warned
    assert not any("cpu_checkpointing" in m or "profile" in m for m in warned)
    for bad, match in (({"cpu_checkpointing": "yes"}, "cpu_checkpointing='yes'.*must be true or false"),
                       ({"contiguous_memory_optimization": True}, "needs partition_activations=true"),
                       ({"number_checkpoints": 0}, "number_checkpoints"), ({"partition_activation": True},
                                                                          "did you mean")):
        with pytest.raises(ConfigError, match=match):
            resolve_runner_config({"activation_checkpointing": bad})
    # DeepSpeed's documented section, as users copy it: null is "unset", not a bad number.
    documented = {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
                  "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}
    assert resolve_runner_config({"activation_checkpointing": documented}).activation_checkpointing.blocks is True


def test_runner_argument_and_config_section_precedence():
    config = {"activation_checkpointing": {"cpu_checkpointing": True}}
    from_file = Runner(SingleDevice("cpu"), config=config).activation_checkpointing
    assert from_file.enabled and from_file.offload_to_cpu
    off = Runner(SingleDevice("cpu"), config=config, activation_checkpointing=False).activation_checkpointing
    assert not off.enabled and off.deepspeed == {"cpu_checkpointing": True}  # deepspeed.checkpointing still told
    explicit = Runner(SingleDevice("cpu"), config=config,
                      activation_checkpointing=ActivationCheckpointing(use_reentrant=True)).activation_checkpointing
    assert explicit.use_reentrant and not explicit.offload_to_cpu and explicit.deepspeed == {"cpu_checkpointing": True}
    assert Runner(SingleDevice("cpu")).activation_checkpointing is None
    runner = Runner(SingleDevice("cpu"), activation_checkpointing="LlamaBlock")
    model = runner.setup(_llama())
    assert checkpointed_modules(model) == list(model.layers)


# ---- the Trainer --------------------------------------------------------------------------------------------


def _trainer(tmp_path, model, **kw):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                             logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch", **kw)
    return Trainer(model, args, train_dataset=Subset(ByteTextDataset(TEXT, seq_len=16, stride=16), range(16)))


def test_trainer_checkpoints_shardkit_llama_through_the_runner_exactly(tmp_path):
    runs = []
    for kw in ({}, {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": '{"use_reentrant": true}'}):
        model = _llama()
        calls = _count_mlp_calls(model)
        trainer = _trainer(tmp_path, model, **kw)
        trainer.train()
        runs.append(([h["loss"] for h in trainer.state.log_history if "loss" in h], calls[0],
                     {k: v.clone() for k, v in model.state_dict().items()}, trainer.runner.activation_checkpointing))
    (off_losses, off_calls, off_state, off_ac), (on_losses, on_calls, on_state, on_ac) = runs
    assert off_ac is None and on_ac.use_reentrant and on_ac.blocks is True
    assert on_losses == off_losses and all(torch.equal(on_state[k], off_state[k]) for k in off_state)
    assert (off_calls, on_calls) == (2, 4)  # 2 steps: the MLP of block 0 ran once, then twice, per step


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}])
def test_trainer_lets_a_hugging_face_model_checkpoint_itself(tmp_path, kwargs):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(config)
    trainer = _trainer(tmp_path, model, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    layers = model.model.layers
    assert all(layer.gradient_checkpointing for layer in layers)
    assert layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": bool(kwargs)}
    assert trainer.runner.activation_checkpointing is None  # no second patch over HF's own


def test_trainer_keeps_a_deepspeed_sections_options_and_takes_its_kwargs(tmp_path):
    model = _llama()
    trainer = _trainer(tmp_path, model, deepspeed={"activation_checkpointing": {"cpu_checkpointing": True}},
                       gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True,
                                                                                   "preserve_rng_state": True})
    ac = trainer.runner.activation_checkpointing
    assert (ac.blocks, ac.offload_to_cpu, ac.use_reentrant, dict(ac.checkpoint_kwargs)) == (
        True, True, True, {"preserve_rng_state": True})
    trainer.train()
    assert checkpointed_modules(model) == list(model.layers)


def test_reentrant_under_ddp_with_find_unused_parameters_is_refused_by_name(tmp_path):
    from types import SimpleNamespace

    from shardkit.strategies.activation_checkpointing import enable_gradient_checkpointing
    from shardkit.strategies.ddp import DDP

    # Measured on 2 ranks: the backward fails with "Expected to mark a variable ready only once".
    with pytest.raises(ActivationCheckpointingError, match=r"use_reentrant=True cannot run under "
                                                           r"DDP\(find_unused_parameters=True\)"):
        apply_activation_checkpointing(_llama(), ActivationCheckpointing(use_reentrant=True),
                                       strategy=DDP(find_unused_parameters=True))
    assert apply_activation_checkpointing(_llama(), ActivationCheckpointing(use_reentrant=True),
                                          strategy=DDP(find_unused_parameters=True, static_graph=True))
    args = SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    runner = SimpleNamespace(strategy=DDP(find_unused_parameters=True), activation_checkpointing=None)
    with pytest.raises(ActivationCheckpointingError, match="gradient_checkpointing_kwargs: use_reentrant=True"):
        enable_gradient_checkpointing(_llama(), args, runner)
