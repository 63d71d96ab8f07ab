"""One translator for FSDP options (issue 23): the Trainer's fsdp_config (keys with or without the fsdp_ prefix,
FSDP1 and FSDP2 spellings) and Accelerate's YAML section give the same FSDP settings; every key acts, says it has
no effect under FSDP2, or is refused by name. And "auto" warmup_num_steps is filled as transformers fills it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from shardkit.config import ConfigError, ConfigKeyError, common, resolve_runner_config
from shardkit.config.fsdp_options import fsdp_spec, trainer_fsdp_spec
from shardkit.config.optim import build_scheduler

SEEDS = Path(__file__).resolve().parents[1] / "seeds"

TRAINER_CONFIG = {  # transformers' fsdp_config spellings, every key the seeds and HF's docs use
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "backward_prefetch": "backward_pre",
    "forward_prefetch": False, "cpu_ram_efficient_loading": True, "sync_module_states": True,
    "state_dict_type": "SHARDED_STATE_DICT", "activation_checkpointing": True, "offload_params": False,
    "use_orig_params": False, "limit_all_gathers": True, "reshard_after_forward": True, "version": 2,
    "min_num_params": 0, "xla": False,
}
WANT = {"sharding": "full", "reshard_after_forward": True, "auto_wrap": ("LlamaDecoderLayer",),
        "state_dict_type": "sharded", "cpu_offload": False, "activation_checkpointing": True,
        "sync_module_states": True, "cpu_ram_efficient_loading": True}


def test_trainer_and_accelerate_spellings_give_the_same_settings():
    prefixed = {f"fsdp_{k}": v for k, v in TRAINER_CONFIG.items()}
    assert trainer_fsdp_spec("full_shard auto_wrap", TRAINER_CONFIG) == ("FSDP", WANT)
    assert trainer_fsdp_spec(True, prefixed) == ("FSDP", WANT)
    assert fsdp_spec(prefixed, "fsdp.yaml") == ("FSDP", WANT)
    # JSON-from-the-command-line strings and the legacy words
    name, kwargs = trainer_fsdp_spec("shard_grad_op offload", {"fsdp_min_num_params": "2000",
                                                               "auto_wrap_policy": "SIZE_BASED_WRAP"})
    assert kwargs["sharding"] == "grad_op" and kwargs["cpu_offload"] and kwargs["auto_wrap"] == 2000


def test_options_are_refused_by_name_or_say_they_have_no_effect(caplog, monkeypatch):
    monkeypatch.setattr(common, "_WARNED", set())  # each no-effect warning is logged once per process
    with pytest.raises(ConfigKeyError, match=r"fsdp_config\.transformer_layer_cls_to_wrp.*cls_to_wrap'"):
        trainer_fsdp_spec(True, {"transformer_layer_cls_to_wrp": ["LlamaDecoderLayer"]})
    with pytest.raises(NotImplementedError, match=r"fsdp_config\.xla: true.*TPUs"):
        trainer_fsdp_spec(True, {"xla": True})
    with pytest.raises(ConfigError, match=r"sync_module_states=True and fsdp_sync_module_states=False"):
        trainer_fsdp_spec(True, {"sync_module_states": True, "fsdp_sync_module_states": False})
    with pytest.raises(ConfigError, match=r"unknown option 'ful_shard'.*full_shard"):
        trainer_fsdp_spec("ful_shard", {})
    with pytest.raises(ConfigError, match=r"fsdp_config\.backward_prefetch: 'sideways'"):
        trainer_fsdp_spec(True, {"backward_prefetch": "sideways"})
    with caplog.at_level(logging.WARNING, logger="shardkit.config"):
        trainer_fsdp_spec(True, {"limit_all_gathers": False, "use_orig_params": "false"})
    assert "limit_all_gathers: false has no effect" in caplog.text
    assert "use_orig_params: false has no effect" in caplog.text


def test_the_seeds_zero3_config_with_no_warmup_fills_warmup_num_steps_as_transformers_does():
    # the Trainer's default warmup (0 steps): DeepSpeed 0.19.6+ refuses warmup_num_steps=0, transformers fills 1
    resolved = resolve_runner_config(SEEDS / "ds_config_zero3.json", micro_batch_size=2, gradient_accumulation_steps=1,
                                     optimizer_params={"lr": 1e-3},
                                     scheduler_params={"warmup_num_steps": 0, "warmup_max_lr": 1e-3,
                                                       "warmup_min_lr": 0.0})
    assert resolved.scheduler["params"]["warmup_num_steps"] == 1
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    build_scheduler(resolved.scheduler, optimizer)  # DeepSpeed's own WarmupLR accepts it
    raw = json.loads((SEEDS / "ds_config_zero3.json").read_text())
    raw["scheduler"]["params"]["warmup_num_steps"] = 0
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps=0 .* must be"):
        resolve_runner_config(raw, micro_batch_size=2)


def test_the_trainer_reads_fsdp_config_through_the_translator(tmp_path):
    from shardkit.models.llama import Llama, LlamaConfig
    from shardkit.trainer import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard",
                             fsdp_config={"fsdp_transformer_layer_cls_to_wrp": ["Block"]}, report_to="none")
    tiny = Llama(LlamaConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_position=8))
    with pytest.raises(ConfigKeyError, match=r"fsdp_config\.fsdp_transformer_layer_cls_to_wrp"):
        Trainer(model=tiny, args=args)  # was dropped silently


def test_cpu_ram_efficient_loading_without_sync_is_refused_by_name():
    from shardkit.strategies.fsdp import FSDP

    with pytest.raises(ValueError, match="cpu_ram_efficient_loading=True needs sync_module_states=True"):
        FSDP(cpu_ram_efficient_loading=True, sync_module_states=False)
    with pytest.raises(ConfigError, match=r"fsdp_config\.cpu_ram_efficient_loading: true needs sync_module_states"):
        trainer_fsdp_spec(True, {"cpu_ram_efficient_loading": "true", "sync_module_states": "false"})
    assert FSDP(**trainer_fsdp_spec(True, {"cpu_ram_efficient_loading": True})[1]).settings.cpu_ram_efficient_loading
