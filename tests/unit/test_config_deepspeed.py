"""DeepSpeed JSON configs: fixtures map to the right objects; typos, mismatches and bad combinations fail by name."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from shardkit.config import (
    ConfigError,
    ConfigKeyError,
    ConfigMismatchError,
    resolve_runner_config,
)
from shardkit.config.common import load_mapping
from shardkit.config.deepspeed import precision_from_deepspeed, strategy_spec_from_deepspeed
from shardkit.config.optim import build_optimizer, build_scheduler
from shardkit.precision import BF16, FP16, FP32


def _fixtures() -> Path:
    # CI keeps shared/ beside the clone: <clone>/../shared/fixtures.
    return Path(os.environ.get("SHARDKIT_FIXTURES") or Path(__file__).resolve().parents[3] / "shared" / "fixtures")


DS = _fixtures() / "deepspeed"
needs_fixtures = pytest.mark.skipif(not DS.is_dir(), reason=f"fixture folder {DS} is absent (set SHARDKIT_FIXTURES)")

EXPECTED = {
    "precision_and_misc.json": ("ZeRO2", {}, FP32),
    "zero1.json": ("ZeRO1", {}, FP32),
    "zero2_offload.json": ("ZeRO2", {"offload_optimizer": "cpu", "reduce_bucket_size": 500_000_000,
                                     "allgather_bucket_size": 500_000_000, "overlap_comm": True,
                                     "contiguous_gradients": True}, FP32),
    "zero3_inference.json": ("ZeRO3", {"offload_params": "cpu", "reduce_bucket_size": 1_048_576,
                                       "prefetch_bucket_size": 943_718, "param_persistence_threshold": 10_240}, FP32),
    "zero3_infinity_nvme.json": ("ZeROInfinity", {"buffer_count": 5, "buffer_size": 100_000_000,
                                                  "reduce_bucket_size": "auto", "prefetch_bucket_size": "auto",
                                                  "gather_16bit_weights_on_model_save": True}, FP32),
    "zero3_offload.json": ("ZeRO3", {"offload_optimizer": "cpu", "offload_params": "cpu",
                                     "param_persistence_threshold": "auto", "max_live_parameters": 1_000_000_000},
                           FP32),
    "zero3_offload_cpu_full.json": ("ZeRO3", {"offload_optimizer": "cpu", "offload_params": "cpu"}, FP32),
}


def _load(name: str, tmp_path: Path) -> dict:
    raw = load_mapping(DS / name)
    for key in ("offload_param", "offload_optimizer"):
        section = raw.get("zero_optimization", {}).get(key, {})
        if "nvme_path" in section:
            section["nvme_path"] = str(tmp_path / "nvme")
    return raw


@needs_fixtures
def test_every_fixture_is_expected():
    assert sorted(p.name for p in DS.glob("*.json")) == sorted(EXPECTED)


@needs_fixtures
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_maps_to_strategy_and_precision(name, tmp_path):
    raw = _load(name, tmp_path)
    strategy, kwargs = strategy_spec_from_deepspeed(raw, name, world_size=2)
    want_strategy, want_kwargs, want_precision = EXPECTED[name]
    assert strategy == want_strategy
    assert {k: kwargs.get(k) for k in want_kwargs} == want_kwargs
    assert type(precision_from_deepspeed(raw, name)) is want_precision


@needs_fixtures
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_builds_the_objects(name, tmp_path):
    pytest.importorskip("shardkit.strategies.zero")
    resolved = resolve_runner_config(_load(name, tmp_path), world_size=2)
    assert type(resolved.strategy).__name__ == EXPECTED[name][0]
    assert resolved.gradient_accumulation_steps == 1
    assert resolved.source == "the DeepSpeed config dict"


@needs_fixtures
def test_fixture_details(tmp_path):
    pytest.importorskip("shardkit.strategies.zero")
    infinity = resolve_runner_config(_load("zero3_infinity_nvme.json", tmp_path), world_size=2).strategy.settings
    assert infinity.aio["queue_depth"] == 32 and infinity.nvme_path == str(tmp_path / "nvme")
    assert infinity.extra["zero_optimization"]["offload_optimizer"]["buffer_count"] == 4
    inference = resolve_runner_config(DS / "zero3_inference.json", world_size=2)
    assert inference.micro_batch_size == 1 and inference.gradient_accumulation_steps == 1  # 2 = 1 * 1 * 2
    misc = resolve_runner_config(DS / "precision_and_misc.json", precision=BF16(), world_size=2)
    assert isinstance(misc.precision, BF16) and "checkpoint.use_node_local_storage" in misc.ignored_keys


# ---- unknown keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("config, dotted, suggestion", [
    ({"gradient_acumulation_steps": 2}, "gradient_acumulation_steps", "gradient_accumulation_steps"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "zero_optimization.overlap_com",
     "zero_optimization.overlap_comm"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"devce": "cpu"}}}, "zero_optimization.offload_param.devce",
     "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "zero_optimization.offload_optimizer.pin_memory"),
    ({"zero_optimization": {"stage": 3, "aio": {"queue_dept": 8}}}, "zero_optimization.aio.queue_dept",
     "zero_optimization.aio.queue_depth"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 100}}, "fp16.loss_scale_windw", "fp16.loss_scale_window"),
    ({"bf16": {"enable": True}}, "bf16.enable", "bf16.enabled"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, "optimizer.params.weight_decy",
     "optimizer.params.weight_decay"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}}, "scheduler.params.warmup_num_step",
     "scheduler.params.warmup_num_steps"),
])
def test_unknown_key_names_path_and_closest(config, dotted, suggestion):
    with pytest.raises(ConfigKeyError) as err:
        resolve_runner_config(config)
    assert repr(dotted) in str(err.value) and repr(suggestion) in str(err.value)


def test_unknown_optimizer_type_suggests():
    with pytest.raises(ConfigError, match="'AdamW'"):
        resolve_runner_config({"optimizer": {"type": "AdamWW", "params": {}}})


# ---- explicit values against the Runner's -----------------------------------------------------


def test_mismatch_names_both_values_and_sources(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 8}))
    with pytest.raises(ConfigMismatchError) as err:
        resolve_runner_config(path, gradient_accumulation_steps=4)
    message = str(err.value)
    assert "gradient_accumulation_steps: 8 in" in message and str(path) in message
    assert "4 from Runner(gradient_accumulation_steps=...)" in message


@pytest.mark.parametrize("config, kwargs, needle", [
    ({"gradient_clipping": 1.0}, {"max_grad_norm": 0.5}, "gradient_clipping: 1.0"),
    ({"train_micro_batch_size_per_gpu": 4}, {"micro_batch_size": 2}, "train_micro_batch_size_per_gpu: 4"),
    ({"bf16": {"enabled": True}}, {"precision": FP16()}, "precision: bf16"),
    ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, {"precision": BF16()}, "precision: fp32"),
    ({"fp16": {"enabled": "auto", "loss_scale_window": 100}}, {"precision": FP16()}, "fp16.loss_scale_window: 100"),
    ({"communication_data_type": "bf16"}, {"precision": FP32()}, "communication_data_type: 'bf16'"),
    ({"zero_optimization": {"stage": 2}}, {"strategy": object()}, "strategy: ZeRO2"),
])
def test_other_mismatches(config, kwargs, needle):
    with pytest.raises(ConfigMismatchError, match="from") as err:
        resolve_runner_config(config, **kwargs)
    assert needle in str(err.value)


def test_agreeing_values_pass():
    resolved = resolve_runner_config({"gradient_accumulation_steps": 4, "bf16": {"enabled": True}},
                                     gradient_accumulation_steps=4, precision=BF16())
    assert resolved.gradient_accumulation_steps == 4 and isinstance(resolved.precision, BF16)


# ---- "auto" ------------------------------------------------------------------------------------


def test_auto_takes_runner_values_then_defaults():
    config = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
              "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}
    given = resolve_runner_config(config, gradient_accumulation_steps=3, max_grad_norm=0.5, precision=FP16(),
                                  micro_batch_size=2)
    assert (given.gradient_accumulation_steps, given.max_grad_norm, given.micro_batch_size) == (3, 0.5, 2)
    assert isinstance(given.precision, FP16)
    defaults = resolve_runner_config(config)
    assert (defaults.gradient_accumulation_steps, defaults.max_grad_norm, defaults.micro_batch_size) == (1, None, None)
    assert isinstance(defaults.precision, FP32)


def test_fp16_knobs_and_comm_dtype_map_one_to_one():
    precision = resolve_runner_config({"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50,
                                                "hysteresis": 3, "min_loss_scale": 2},
                                       "communication_data_type": "bf16"}).precision
    assert isinstance(precision, FP16) and precision.current_loss_scale == 2.0**8
    assert (precision.loss_scale_window, precision.hysteresis, precision.min_loss_scale) == (50, 3, 2)
    assert precision.comm_dtype == torch.bfloat16


def test_optimizer_and_scheduler_auto():
    config = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                                                 "total_num_steps": "auto"}}}
    resolved = resolve_runner_config(config, optimizer_params={"lr": 0.01},
                                     scheduler_params={"warmup_num_steps": 2, "total_num_steps": 10})
    assert resolved.optimizer == {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8,
                                                              "weight_decay": 0.01}}
    assert resolved.scheduler["params"] == {"warmup_max_lr": 0.01, "warmup_num_steps": 2, "total_num_steps": 10}
    optimizer = build_optimizer(resolved.optimizer, [torch.nn.Parameter(torch.ones(2))])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 0.01
    assert type(build_scheduler(resolved.scheduler, optimizer)).__name__ == "WarmupDecayLR"
    with pytest.raises(ConfigError, match="total_num_steps"):
        resolve_runner_config({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    with pytest.raises(ConfigMismatchError, match="optimizer.params.lr: 0.1"):
        resolve_runner_config({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, optimizer_params={"lr": 0.2})


def test_auto_where_nothing_fills_it_fails():
    with pytest.raises(ConfigError, match="zero_optimization.stage: 'auto' is not accepted"):
        resolve_runner_config({"zero_optimization": {"stage": "auto"}})


# ---- batch sizes -------------------------------------------------------------------------------


def test_train_batch_size_inconsistent_shows_the_numbers():
    config = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as err:
        resolve_runner_config(config, world_size=2)
    assert "train_batch_size=10" in str(err.value) and "micro_batch_size_per_gpu(2)" in str(err.value)
    assert "world_size(2) = 8" in str(err.value)


def test_train_batch_size_derives_the_missing_one():
    assert resolve_runner_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2},
                                 world_size=2).gradient_accumulation_steps == 4
    assert resolve_runner_config({"train_batch_size": 16}, gradient_accumulation_steps=2,
                                 world_size=2).micro_batch_size == 4
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_runner_config({"train_batch_size": 15, "gradient_accumulation_steps": 2}, world_size=2)


# ---- stages, offload, unsupported keys -----------------------------------------------------------


@pytest.mark.parametrize("zero, needle", [
    ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device='cpu' with stage 1"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device='cpu' needs zero_optimization.stage=3"),
    ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "'nvme' needs stage 3"),
    ({"stage": 0, "offload_param": {"device": "cpu"}}, "needs zero_optimization.stage=3"),
    ({"stage": 5}, "stage=5"),
    ({"stage": 3, "offload_param": {"device": "gpu"}}, "is not a device"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "needs zero_optimization.offload_param.nvme_path"),
])
def test_bad_stage_offload(zero, needle):
    with pytest.raises(ConfigError) as err:
        resolve_runner_config({"zero_optimization": zero})
    assert needle in str(err.value)


def test_nvme_path_not_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(blocker / "swap")},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(blocker / "swap")}}
    with pytest.raises(ConfigError, match="nvme_path .*a_file.* is a file, not a directory"):
        resolve_runner_config({"zero_optimization": zero})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere, so a read-only directory cannot be made")
def test_nvme_path_read_only(tmp_path):
    tmp_path.chmod(0o500)
    try:
        zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "swap")}}
        with pytest.raises(ConfigError, match="is not writable"):
            resolve_runner_config({"zero_optimization": zero})
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize("config, key", [
    ({"amp": {"enabled": True}}, "amp"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "fp16.consecutive_hysteresis"),
    ({"pipeline": {"stages": 2}}, "pipeline"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel"),
])
def test_unhonourable_keys_raise_not_implemented(config, key):
    with pytest.raises(NotImplementedError, match=f"^{key}="):
        resolve_runner_config(config)


def test_inert_keys_accepted_and_logged(caplog):
    config = {"steps_per_print": 10, "wall_clock_breakdown": True, "amp": {"enabled": False},
              "tensorboard": {"enabled": True, "output_path": "tb"}}
    with caplog.at_level(logging.DEBUG, logger="shardkit.config"):
        resolved = resolve_runner_config(config)
    assert {"steps_per_print", "wall_clock_breakdown", "amp"} <= set(resolved.ignored_keys)
    assert "not acted on" in caplog.text and "steps_per_print" in caplog.text
    # Issue 27: the monitor sections are trackers now, not ignored keys.
    assert not any(k.startswith("tensorboard") for k in resolved.ignored_keys)
    trackers = [(t.name, t.logging_dir, t.run_name) for t in resolved.trackers]
    assert trackers == [("tensorboard", "tb", "DeepSpeedJobName")]


def test_stage0_is_data_parallel():
    assert strategy_spec_from_deepspeed({"zero_optimization": {"stage": 0}}, world_size=2)[0] == "DDP"
    assert strategy_spec_from_deepspeed({"zero_optimization": {"stage": 0}}, world_size=1)[0] == "SingleDevice"
