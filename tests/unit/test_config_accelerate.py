"""Accelerate YAML configs: every fixture maps to the right objects; nothing falls back silently."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from shardkit.config import ConfigError, ConfigKeyError, ConfigMismatchError, ConfigResourceError, resolve_runner_config
from shardkit.config.accelerate import (
    CONFIG_FILE_ENV,
    check_resources,
    launch_args_from_yaml,
    load_accelerate_config,
)
from shardkit.precision import BF16, FP16, FP32


def _fixtures() -> Path:
    return Path(os.environ.get("SHARDKIT_FIXTURES") or Path(__file__).resolve().parents[3] / "shared" / "fixtures")


ACC = _fixtures() / "accelerate"
needs_fixtures = pytest.mark.skipif(not ACC.is_dir(), reason=f"fixture folder {ACC} is absent (set SHARDKIT_FIXTURES)")

# file -> (distributed_type, strategy spec or None for DeepSpeed, mixed precision, processes, machines)
EXPECTED = {
    "ddp_multinode.yaml": ("MULTI_GPU", ("DDP", {}), "fp16", 8, 2),
    "deepspeed_file.yaml": ("DEEPSPEED", None, "no", 4, 1),
    "deepspeed_plugin.yaml": ("DEEPSPEED", None, "bf16", 4, 1),
    "fsdp.yaml": ("FSDP", ("FSDP", {"sharding": "full", "auto_wrap": ("BertLayer",), "state_dict_type": "full",
                                    "cpu_offload": False, "activation_checkpointing": False,
                                    "sync_module_states": True}), "bf16", 2, 1),
    "fsdp_peft.yaml": ("FSDP", ("FSDP", {"sharding": "full", "auto_wrap": None, "state_dict_type": "sharded",
                                         "cpu_offload": False, "activation_checkpointing": False,
                                         "sync_module_states": True, "cpu_ram_efficient_loading": True}),
                       "bf16", 8, 1),
    "tensor_parallel.yaml": ("TP", ("TensorParallel", {"tp_size": 4}), "no", 4, 1),
}


def _write(tmp_path: Path, data: dict, name: str = "acc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "no",
        "num_machines": 1, "num_processes": 2, "machine_rank": 0, "use_cpu": True}


@needs_fixtures
def test_every_fixture_is_expected():
    assert sorted(p.name for p in ACC.glob("*.yaml")) == sorted(EXPECTED)


@needs_fixtures
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses(name, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(ACC)  # deepspeed_file.yaml names its JSON relative to the job's directory
    cfg = load_accelerate_config(ACC / name)
    kind, spec, mixed, processes, machines = EXPECTED[name]
    assert (cfg.distributed_type, cfg.strategy, cfg.mixed_precision) == (kind, spec, mixed)
    assert (cfg.num_processes, cfg.num_machines, cfg.machine_rank) == (processes, machines, 0)
    assert cfg.env[CONFIG_FILE_ENV] == str((ACC / name).resolve())


@needs_fixtures
def test_deepspeed_fixtures_resolve_to_zero(monkeypatch):
    pytest.importorskip("shardkit.strategies.zero")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(ACC)  # deepspeed_config_file is relative to the job's directory, as in accelerate launch
    from_file = resolve_runner_config(ACC / "deepspeed_file.yaml")
    settings = from_file.strategy.settings
    assert type(from_file.strategy).__name__ == "ZeRO3" and isinstance(from_file.precision, FP32)
    assert (settings.offload_optimizer, settings.offload_params) == ("cpu", "cpu")
    assert Path(from_file.source).resolve() == (ACC / "ds_zero3_config.json").resolve()
    assert from_file.optimizer["type"] == "AdamW"
    inline = resolve_runner_config(ACC / "deepspeed_plugin.yaml")
    assert type(inline.strategy).__name__ == "ZeRO2" and inline.strategy.settings.offload_optimizer == "cpu"
    assert isinstance(inline.precision, BF16) and inline.max_grad_norm == 0.7
    assert inline.gradient_accumulation_steps == 1


@needs_fixtures
def test_data_parallel_and_fsdp_fixtures_resolve(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ddp = resolve_runner_config(ACC / "ddp_multinode.yaml")
    assert type(ddp.strategy).__name__ == "DDP" and isinstance(ddp.precision, FP16)
    fsdp = resolve_runner_config(ACC / "fsdp_peft.yaml")
    assert type(fsdp.strategy).__name__ == "FSDP" and isinstance(fsdp.precision, BF16)
    assert fsdp.strategy.settings.state_dict_type == "sharded"


@needs_fixtures
def test_tensor_parallel_fixture_resolves(monkeypatch):
    pytest.importorskip("shardkit.strategies.tensor_parallel")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    resolved = resolve_runner_config(ACC / "tensor_parallel.yaml")
    assert type(resolved.strategy).__name__ == "TensorParallel" and isinstance(resolved.precision, FP32)


@needs_fixtures
def test_launch_args_per_machine(monkeypatch):
    args = launch_args_from_yaml(ACC / "ddp_multinode.yaml")  # 8 processes over 2 machines
    assert {k: args[k] for k in ("num_processes", "num_machines", "machine_rank", "main_process_ip",
                                 "main_process_port")} == {"num_processes": 4, "num_machines": 2, "machine_rank": 0,
                                                           "main_process_ip": "192.168.20.1",
                                                           "main_process_port": 9898}
    assert args["env"][CONFIG_FILE_ENV] == str((ACC / "ddp_multinode.yaml").resolve())


@pytest.mark.parametrize("efficient", [True, False])
def test_launch_exports_cpu_ram_efficient_loading_as_accelerate_launch_does(tmp_path, efficient):
    """transformers' from_pretrained reads these two variables, before the script builds any Runner."""
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "no",
                                    "fsdp_config": {"fsdp_cpu_ram_efficient_loading": efficient,
                                                    "fsdp_sync_module_states": True}}))
    env = launch_args_from_yaml(path)["env"]
    want = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"} if efficient else {}
    assert {k: v for k, v in env.items() if k in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")} == want


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, dotted, suggestion", [
    ({"num_proceses": 2}, "num_proceses", "num_processes"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_stratgy": 1}}, "fsdp_config.fsdp_sharding_stratgy",
     "fsdp_config.fsdp_sharding_strategy"),
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stag": 2}}, "deepspeed_config.zero_stag",
     "deepspeed_config.zero_stage"),
    ({"distributed_type": "TP", "tp_config": {"tp_sze": 2}}, "tp_config.tp_sze", "tp_config.tp_size"),
])
def test_unknown_key(tmp_path, change, dotted, suggestion):
    with pytest.raises(ConfigKeyError) as err:
        load_accelerate_config(_write(tmp_path, {**BASE, **change}))
    assert repr(dotted) in str(err.value) and repr(suggestion) in str(err.value)


def test_unknown_key_in_deepspeed_file_named_by_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}}')
    path = _write(tmp_path, {**BASE, "distributed_type": "DEEPSPEED",
                             "deepspeed_config": {"deepspeed_config_file": "ds.json"}})
    with pytest.raises(ConfigKeyError, match="reduce_bucket_size"):
        resolve_runner_config(path, world_size=2)


def _cfg(tmp_path, **change):
    return load_accelerate_config(_write(tmp_path, {**BASE, "use_cpu": False, "distributed_type": "MULTI_GPU",
                                                    **change}))


def test_more_processes_than_gpus(tmp_path):
    with pytest.raises(ConfigResourceError, match="asks for 8 processes per machine .* only 2 GPUs"):
        check_resources(_cfg(tmp_path, num_processes=8), device_count=2)
    with pytest.raises(ConfigResourceError, match=r"\[3\] do not exist"):
        check_resources(_cfg(tmp_path, gpu_ids="0,3"), device_count=2)
    check_resources(_cfg(tmp_path, num_processes=2), device_count=2)


def test_machines_that_cannot_exist(tmp_path):
    with pytest.raises(ConfigResourceError, match="needs main_process_ip"):
        check_resources(_cfg(tmp_path, num_machines=2, num_processes=4), device_count=8)
    with pytest.raises(ConfigResourceError, match="machine_rank: 3 .* out of range"):
        check_resources(_cfg(tmp_path, num_machines=2, num_processes=4, machine_rank=3,
                             main_process_ip="10.0.0.1"), device_count=8)
    with pytest.raises(ConfigError, match="divide evenly by num_machines"):
        _cfg(tmp_path, num_machines=2, num_processes=3, main_process_ip="10.0.0.1")


def test_launch_reports_resource_errors(tmp_path):
    from shardkit.distributed.cli import LaunchUsageError

    path = _write(tmp_path, {**BASE, "num_machines": 2, "num_processes": 4})
    with pytest.raises(LaunchUsageError, match="needs main_process_ip"):
        launch_args_from_yaml(path)


def test_world_size_not_divisible_by_tp_size(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"world size 4 \(num_processes\) is not divisible by tp_config.tp_size\(3\)"):
        load_accelerate_config(_write(tmp_path, {**BASE, "num_processes": 4, "distributed_type": "TP",
                                                 "tp_config": {"tp_size": 3}}))


def test_never_falls_back(tmp_path):
    with pytest.raises(ConfigError, match="fsdp_config is set .* distributed_type is MULTI_CPU"):
        load_accelerate_config(_write(tmp_path, {**BASE, "fsdp_config": {"fsdp_sharding_strategy": 1}}))
    with pytest.raises(NotImplementedError, match="MULTI_NPU"):
        load_accelerate_config(_write(tmp_path, {**BASE, "distributed_type": "MULTI_NPU"}))
    with pytest.raises(ConfigError, match="did you mean 'FSDP'"):
        load_accelerate_config(_write(tmp_path, {**BASE, "distributed_type": "FSPD"}))
    fsdp = load_accelerate_config(_write(tmp_path, {**BASE, "distributed_type": "FSDP"}))
    assert fsdp.strategy[0] == "FSDP"  # on CPU too: FSDP, not DDP


@pytest.mark.parametrize("fsdp_config, expected", [
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, {"sharding": "grad_op"}),
    ({"fsdp_sharding_strategy": 4}, {"sharding": "hybrid"}),
    ({"fsdp_sharding_strategy": "NO_SHARD"}, {"sharding": "none"}),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": 1000}, {"auto_wrap": 1000}),
    ({"fsdp_auto_wrap_policy": "NO_WRAP"}, {"auto_wrap": False}),
    ({"fsdp_offload_params": True, "fsdp_activation_checkpointing": True}, {"cpu_offload": True,
                                                                            "activation_checkpointing": True}),
    ({"fsdp_version": 2, "fsdp_reshard_after_forward": False}, {"reshard_after_forward": False}),
])
def test_fsdp_options(tmp_path, fsdp_config, expected):
    cfg = load_accelerate_config(_write(tmp_path, {**BASE, "distributed_type": "FSDP", "fsdp_config": fsdp_config}))
    assert {k: cfg.strategy[1][k] for k in expected} == expected


def test_fsdp_ram_efficient_loading_needs_sync(tmp_path):
    with pytest.raises(ConfigError, match="needs fsdp_sync_module_states: true"):
        load_accelerate_config(_write(tmp_path, {**BASE, "distributed_type": "FSDP", "fsdp_config": {
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": False}}))


def test_runner_mismatch(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = _write(tmp_path, {**BASE, "mixed_precision": "bf16", "distributed_type": "FSDP"})
    with pytest.raises(ConfigMismatchError, match="mixed_precision: 'bf16' in .* but 'fp16' from Runner"):
        resolve_runner_config(path, precision=FP16())
    with pytest.raises(ConfigMismatchError, match="strategy: FSDP .* but object from Runner"):
        resolve_runner_config(path, strategy=object())
    ds = _write(tmp_path, {**BASE, "distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                           "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 8}}, "ds.yaml")
    with pytest.raises(ConfigMismatchError, match="gradient_accumulation_steps: 8 in .*ds.yaml .* but 2 from"):
        resolve_runner_config(ds, gradient_accumulation_steps=2)


def test_use_cpu_and_gpu_ids_reach_the_environment(tmp_path):
    assert load_accelerate_config(_write(tmp_path, BASE)).env["CUDA_VISIBLE_DEVICES"] == ""
    cfg = _cfg(tmp_path, gpu_ids="1,0", debug=True)
    assert cfg.env["CUDA_VISIBLE_DEVICES"] == "1,0" and cfg.env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"


def test_shardkit_launch_dry_run_reads_the_file(tmp_path, capsys):
    from shardkit.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    path = _write(tmp_path, {**BASE, "num_processes": 2, "main_process_port": 29555})
    assert main(["launch", "--config_file", str(path), "--dry-run", str(script)]) == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node=2" in out and "--master-port=29555" in out
