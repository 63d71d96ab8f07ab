"""``accelerate launch`` hands the script its config as environment variables (``ACCELERATE_USE_FSDP`` and
``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED`` and ``ACCELERATE_DEEPSPEED_*``); shardkit's Accelerator builds from them
the strategy the same YAML gives under ``shardkit launch``, or refuses a variable by name. The variables here are
the ones Accelerate's own launcher functions write for a YAML; two real ``accelerate launch`` runs on 2 CPU
processes (FSDP2; ZeRO-2 from a DeepSpeed file whose optimizer and scheduler sections DummyOptim/DummyScheduler
stand for) check the job end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardkit import Accelerator
from shardkit.config import ConfigError, common
from shardkit.config.accelerate import load_accelerate_config
from shardkit.config.accelerate_env import LaunchEnvironment, launch_environment
from shardkit.config.deepspeed import build_strategy

pytest.importorskip("accelerate")

_HERE = Path(__file__).resolve().parent
_SCRIPT = _HERE / "accel_launch_script.py"
# Every variable accelerate launch may set that these tests set: each test starts without them.
_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")

# The FSDP seed page's config (FSDP1 spelling) and the DeepSpeed page's inline one, as `accelerate config` writes.
FSDP1_YAML = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "downcast_bf16": "no",
              "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16", "num_machines": 1,
              "num_processes": 2, "rdzv_backend": "static", "same_network": True, "use_cpu": False,
              "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_backward_prefetch_policy": "BACKWARD_PRE", "fsdp_forward_prefetch": False,
                              "fsdp_offload_params": False, "fsdp_sharding_strategy": 1,
                              "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_sync_module_states": True,
                              "fsdp_transformer_layer_cls_to_wrap": "BertLayer", "fsdp_use_orig_params": True}}
DS_INLINE_YAML = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "mixed_precision": "bf16",
                  "num_machines": 1, "num_processes": 2, "use_cpu": False,
                  "deepspeed_config": {"gradient_accumulation_steps": 1, "gradient_clipping": 0.7,
                                       "offload_optimizer_device": "cpu", "offload_param_device": "cpu",
                                       "zero3_init_flag": True, "zero_stage": 2}}
FSDP2_YAML = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "no",
              "num_machines": 1, "num_processes": 2, "use_cpu": False,
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_reshard_after_forward": False,
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False}}
DS_JSON = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}}}



@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith(_PREFIXES) or name == common.CONFIG_FILE_ENV:
            monkeypatch.delenv(name)


def _accelerates_env(config_file: Path, deepspeed: bool = False) -> dict[str, str]:
    """The variables Accelerate's own launcher (1.15: ``prepare_multi_gpu_env`` / ``prepare_deepspeed_cmd_env``)
    writes for ``accelerate launch --config_file config_file``, only those it adds."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "--main_process_port", "0",
                                               "x.py"])
    args, defaults, _ = _validate_launch_command(args)
    if deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(_PREFIXES)}


def _settings(strategy) -> object:
    return strategy.settings


FSDP2_GRAD_OP_YAML = {**FSDP2_YAML, "fsdp_config": {"fsdp_version": 2, "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                                                    "fsdp_offload_params": True, "fsdp_activation_checkpointing": True,
                                                    "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                                                    "fsdp_min_num_params": 1000}}


@pytest.mark.parametrize("config", [FSDP1_YAML, FSDP2_YAML, FSDP2_GRAD_OP_YAML], ids=["fsdp1", "fsdp2", "grad_op"])
def test_accelerates_fsdp_variables_build_the_strategy_the_yaml_gives(config, tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(config))
    env = _accelerates_env(path)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    launched = launch_environment("no", env)
    from_file = build_strategy(load_accelerate_config(path).strategy)
    # accelerate launch writes fsdp_cpu_ram_efficient_loading as true when the YAML leaves it out (its default)
    expected = from_file.settings
    if "fsdp_cpu_ram_efficient_loading" not in yaml.safe_load(path.read_text())["fsdp_config"]:
        expected = type(expected)(**{**vars(expected), "cpu_ram_efficient_loading": True})
    assert launched.kind == "FSDP" and _settings(launched.strategy) == expected


def test_accelerates_deepspeed_variables_build_the_config_the_yaml_gives(tmp_path, monkeypatch):
    inline = tmp_path / "inline.yaml"
    inline.write_text(yaml.safe_dump(DS_INLINE_YAML))
    env = _accelerates_env(inline, deepspeed=True)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    assert launch_environment("bf16", env).deepspeed == load_accelerate_config(inline).deepspeed
    # deepspeed_config_file as Accelerate takes it: relative to where the job runs, not to the YAML's folder
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(DS_JSON))
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "ds.yaml"
    config.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "num_processes": 2,
                                      "deepspeed_config": {"deepspeed_config_file": "ds.json"}}))
    env = _accelerates_env(config, deepspeed=True)
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "ds.json"
    assert launch_environment("no", env).deepspeed == DS_JSON
    assert load_accelerate_config(config).deepspeed == DS_JSON  # shardkit launch reads the same file
    monkeypatch.chdir(tmp_path / "configs")
    with pytest.raises(ConfigError, match="ACCELERATE_DEEPSPEED_CONFIG_FILE=ds.json"):
        launch_environment("no", env)


# What accelerate launch writes for every DeepSpeed job (ACCELERATE_USE_DEEPSPEED alone is no launch).
DS_LAUNCH = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_CONFIG_DS_FIELDS": ""}


@pytest.mark.parametrize("variables,error,text", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "FUL_SHARD"}, ConfigError,
     "FSDP_SHARDING_STRATEGY: 'FUL_SHARD'.*did you mean 'FULL_SHARD'"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_TRANSFORMER_CLS_TO_WRAP": ""}, ConfigError,
     "FSDP_TRANSFORMER_CLS_TO_WRAP: ''.*empty class name"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, NotImplementedError,
     "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD=true"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_IGNORED_MODULES": "Embedding"}, NotImplementedError,
     "FSDP_IGNORED_MODULES"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", **DS_LAUNCH}, ConfigError,
     "two engines"),
    ({**DS_LAUNCH, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "two"}, ConfigError,
     "ACCELERATE_DEEPSPEED_ZERO_STAGE='two'"),
    ({**DS_LAUNCH, "ACCELERATE_GRADIENT_CLIPPING": "-1"}, ConfigError,
     "ACCELERATE_GRADIENT_CLIPPING=-1"),
    ({**DS_LAUNCH, "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "MixtralSparseMoeBlock"},
     NotImplementedError, "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, NotImplementedError, "ACCELERATE_DYNAMO_BACKEND=INDUCTOR"),
    ({"ACCELERATE_USE_MEGATRON_LM": "true"}, NotImplementedError, "ACCELERATE_USE_MEGATRON_LM"),
    ({"ACCELERATE_USE_PARALLELISM_CONFIG": "true"}, NotImplementedError, "ACCELERATE_USE_PARALLELISM_CONFIG"),
    ({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "four"}, ValueError, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS='four'"),
])
def test_a_variable_that_cannot_be_honoured_is_refused_by_name(variables, error, text, monkeypatch):
    if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in variables:  # read by the Accelerator itself
        with pytest.raises(error, match=text):
            launch_environment("no", variables)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error, match=text):  # by the Accelerator, before any process group
        Accelerator()


def test_a_plugin_for_the_other_engine_contradicts_the_launcher(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "")
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED=true.*fsdp_plugin"):
        Accelerator(fsdp_plugin={"fsdp_version": 2})


def test_variables_without_an_engine_keep_the_plain_strategy(monkeypatch):
    for name, value in {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO",
                        "ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "2"}.items():
        monkeypatch.setenv(name, value)
    assert launch_environment("no") is None
    assert type(Accelerator().runner.strategy).__name__ == "SingleDevice"
    # what an FSDP plugin with cpu_ram_efficient_loading exports in-process for from_pretrained: not a launch
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("FSDP_VERSION")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    assert launch_environment("no") is None


@pytest.mark.parametrize("kwargs,text", [
    ({"fsdp_plugin": 5}, "fsdp_plugin=5"),
    ({"fsdp_plugin": "FULL_SHARD"}, "fsdp_plugin='FULL_SHARD'"),
    ({"deepspeed_plugin": 2}, "deepspeed_plugin=2"),
    ({"dataloader_config": {"split_batches": True}}, "dataloader_config="),
    ({"project_config": "out"}, "project_config='out'"),
    ({"gradient_accumulation_plugin": 4}, "gradient_accumulation_plugin=4"),
    ({"kwargs_handlers": object()}, "kwargs_handlers="),
    ({"kwargs_handlers": [5]}, "not a kwargs handler"),
])
def test_plugin_and_config_arguments_of_the_wrong_type_are_named(kwargs, text):
    with pytest.raises(TypeError, match=text):
        Accelerator(**kwargs)


def test_several_deepspeed_plugins_in_one_dict_are_refused():
    utils = pytest.importorskip("accelerate.utils")
    with pytest.raises(NotImplementedError, match="several DeepSpeed plugins"):
        Accelerator(deepspeed_plugin={"student": utils.DeepSpeedPlugin(zero_stage=2)})


def test_downcast_bf16_is_accepted_and_ignored_as_off_tpu_in_accelerate(monkeypatch, caplog):
    monkeypatch.setattr(common, "_WARNED", set())
    with caplog.at_level("WARNING", logger="shardkit.config"):
        Accelerator(downcast_bf16=True)
        Accelerator(downcast_bf16=True)
    assert len([r for r in caplog.records if "downcast_bf16" in r.getMessage()]) == 1


def test_no_effect_notes_come_from_the_main_process_only(monkeypatch, caplog):
    monkeypatch.setattr(common, "_WARNED", set())
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level("WARNING", logger="shardkit.config"):
        launch_environment("no", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_FORWARD_PREFETCH": "true"})
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]
    monkeypatch.setattr(common, "_WARNED", set())
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level("WARNING", logger="shardkit.config"):
        launch_environment("no", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", "FSDP_FORWARD_PREFETCH": "true"})
    assert [r for r in caplog.records if "FSDP_FORWARD_PREFETCH: true has no effect" in r.getMessage()]


@pytest.mark.parametrize("launcher", ["accelerate", "shardkit"])
def test_a_deepspeed_configs_sections_ask_for_the_dummies_as_in_accelerate(launcher, monkeypatch, tmp_path):
    import torch

    (tmp_path / "ds.json").write_text(json.dumps(DS_JSON))
    if launcher == "accelerate":
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    else:  # shardkit launch --config_file ds.yaml hands the ranks the YAML
        (tmp_path / "ds.yaml").write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "deepspeed_config_file": str(tmp_path / "ds.json")}}))
        monkeypatch.setenv(common.CONFIG_FILE_ENV, str(tmp_path / "ds.yaml"))
    accelerator = Accelerator()
    plugin = accelerator.state.deepspeed_plugin  # what Accelerate's examples test to pick DummyOptim
    assert accelerator.distributed_type == "DEEPSPEED" and "optimizer" in plugin.deepspeed_config
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="has an optimizer section and prepare\\(\\) got a torch optimizer"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_dummy_optimizer_without_a_deepspeed_section_is_refused():
    from shardkit.accelerate_compat import DummyOptim, DummyScheduler

    model = __import__("torch").nn.Linear(2, 1)
    optimizer = DummyOptim(model.parameters())
    with pytest.raises(ValueError, match="no DeepSpeed config with an optimizer section"):
        Accelerator().prepare(model, optimizer, DummyScheduler(optimizer))


# ---- the Trainer and a bare Runner under the same variables ---------------------------------------------------

def _set(monkeypatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def fsdp_launch(tmp_path, monkeypatch) -> LaunchEnvironment:
    """accelerate launch's variables for FSDP2_YAML set in this process; what they ask for."""
    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump(FSDP2_YAML))
    env = _accelerates_env(path)
    _set(monkeypatch, env)
    return launch_environment("no", env)


def _args(tmp_path, **kwargs):
    from shardkit.trainer import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], **kwargs)


def test_the_trainer_takes_the_launchers_fsdp_and_precision(fsdp_launch, tmp_path, monkeypatch):
    from shardkit.precision import BF16
    from shardkit.trainer.engine import _launched_engine, _precision_from_args

    strategy, deepspeed, _ = _launched_engine(_args(tmp_path), None, None)
    assert type(strategy).__name__ == "FSDP" and deepspeed is None
    assert strategy.settings == fsdp_launch.strategy.settings
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # transformers' TrainingArguments read it too
    assert isinstance(_precision_from_args(_args(tmp_path), None), BF16)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="ACCELERATE_MIXED_PRECISION='fp8'"):
        _precision_from_args(_args(tmp_path), None)


def test_the_trainers_fsdp_arguments_win_over_the_launchers_with_a_warning(fsdp_launch, tmp_path, monkeypatch,
                                                                          caplog):
    from shardkit.trainer.engine import _launched_engine

    monkeypatch.setattr(common, "_WARNED", set())
    with caplog.at_level("WARNING", logger="shardkit.config"):
        strategy, _, _ = _launched_engine(_args(tmp_path, fsdp="full_shard auto_wrap", fsdp_config={
            "transformer_layer_cls_to_wrap": ["Linear"]}), None, None)
    assert "auto_wrap=('Linear',)" in repr(strategy.settings)  # as transformers builds its plugin from the arguments
    assert [r for r in caplog.records if "TrainingArguments.fsdp" in r.getMessage()
            and "ACCELERATE_USE_FSDP=true" in r.getMessage()]


def test_the_trainer_refuses_the_other_engine_or_strategy_by_name(fsdp_launch, tmp_path, monkeypatch):
    from torch import nn

    from shardkit import DDP
    from shardkit.trainer import Trainer
    from shardkit.trainer.engine import _launched_engine

    with pytest.raises(ConfigError, match=r"ACCELERATE_USE_FSDP=true\) asks for FSDP but Trainer\(strategy=...\) is "
                                          r"DDP.*Drop Trainer\(strategy=...\)"):
        Trainer(model=nn.Linear(2, 1), args=_args(tmp_path), strategy=DDP())
    with pytest.raises(ValueError, match="asks for FSDP but TrainingArguments.deepspeed="):
        _launched_engine(_args(tmp_path, deepspeed={"zero_optimization": {"stage": 2}}), None, None)
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_USE_FSDP", "FSDP_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    # transformers refuses this one too ("--fsdp xxx together with --deepspeed is not possible")
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED=true\\) asks for DEEPSPEED but "
                                         "TrainingArguments.fsdp="):
        _launched_engine(_args(tmp_path, fsdp="full_shard"), None, None)
    strategy, deepspeed, source = _launched_engine(_args(tmp_path), None, None)
    assert strategy is None and deepspeed["zero_optimization"] == {"stage": 2} and "ACCELERATE_USE_DEEPSPEED" in source


def test_a_bare_runner_takes_the_launchers_engine_and_refuses_another_strategy(fsdp_launch, monkeypatch, caplog):
    from shardkit import FSDP, Runner
    from shardkit.runner.assembly import launched_strategy

    strategy, config, _ = launched_strategy(None, None)
    assert strategy.settings == fsdp_launch.strategy.settings and config is None
    with pytest.raises(ConfigError, match=r"ACCELERATE_USE_FSDP=true\) asks for FSDP but Runner\(strategy=...\) is "
                                          r"DDP: the job would train DDP"):
        Runner(strategy="ddp")
    mine = FSDP()  # the script's own FSDP settings win, as an Accelerate plugin argument does; said once
    monkeypatch.setattr(common, "_WARNED", set())
    with caplog.at_level("WARNING", logger="shardkit.config"):
        assert launched_strategy(mine, None)[0] is mine
    assert [r for r in caplog.records if "Runner(strategy=...)" in r.getMessage()]
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_USE_FSDP", "FSDP_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    strategy, config, source = launched_strategy(None, None)
    assert strategy is None and config["zero_optimization"]["stage"] == 3 and config["bf16"] == {"enabled": True}
    with pytest.raises(ConfigError, match="ACCELERATE_USE_DEEPSPEED=true\\) asks for ZeRO3 but Runner"):
        Runner(strategy="zero2")


# ---- real launches ------------------------------------------------------------------------------------------

def _accelerate_launch(config: Path, cwd: Path, *script_args: str) -> list[dict]:
    out = cwd / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES) and k != common.CONFIG_FILE_ENV}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", SHARDKIT_COLLECTIVE_TIMEOUT="120")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
               "2", "--main_process_port", "0", str(_SCRIPT), str(out), *script_args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _learned(records: list[dict]) -> None:
    for record in records:
        assert record["num_processes"] == 2
        assert record["losses"][-1] < 0.5 * record["losses"][0], record["losses"]


def test_accelerate_launch_with_an_fsdp_yaml_trains_fsdp(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(yaml.safe_dump(FSDP2_YAML))
    records = _accelerate_launch(config, tmp_path)
    for record in records:
        assert record["distributed_type"] == "FSDP" and record["strategy"] == "FSDP"
        assert "auto_wrap=('Block',)" in record["settings"] and "reshard_after_forward=False" in record["settings"]
    _learned(records)


def test_accelerate_launch_with_an_fsdp_yaml_trains_shardkits_trainer_with_fsdp(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(yaml.safe_dump(FSDP2_YAML))
    records = _accelerate_launch(config, tmp_path, "trainer")
    for record in records:
        assert record["strategy"] == "FSDP" and record["is_fsdp_enabled"] and record["distributed_type"] == "FSDP"
        assert "auto_wrap=('Block',)" in record["settings"] and "reshard_after_forward=False" in record["settings"]
        assert record["num_processes"] == 2 and len(record["losses"]) == 4
        assert record["losses"][-1] < 0.5 * record["losses"][0], record["losses"]


def test_accelerate_launch_with_a_deepspeed_yaml_trains_zero_with_the_configs_optimizer(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(DS_JSON))  # relative to the job's directory, as in Accelerate
    config = tmp_path / "ds.yaml"
    config.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED",
                                      "mixed_precision": "no", "num_machines": 1, "num_processes": 2,
                                      "deepspeed_config": {"deepspeed_config_file": "ds.json"}}))
    records = _accelerate_launch(config, tmp_path)
    for record in records:
        assert record["distributed_type"] == "DEEPSPEED" and record["strategy"] == "ZeRO2"
        assert record["lr"] == 0.05  # DummyOptim's lr filled the section's "auto", the warmup reached it
    _learned(records)



# ---- shardkit launch's config-as-flags, and the wrap classes ------------------------------------------------

@pytest.mark.parametrize("flags,text", [
    (["--use_fsdp", "--fsdp_sharding_strategy=FUL_SHARD"], "--fsdp_sharding_strategy: 'FUL_SHARD' in shardkit "
                                                           "launch's flags"),
    (["--use_fsdp", "--fsdp_transformer_layer_cls_to_wrap="], "--fsdp_transformer_layer_cls_to_wrap: '' in "
                                                              "shardkit launch's flags .* empty class name"),
    (["--use_deepspeed", "--gradient_clipping=-1"], "--gradient_clipping=-1 in shardkit launch's flags"),
    (["--use_deepspeed", "--deepspeed_config_file=nope.json"], "--deepspeed_config_file: .*nope.json"),
])
def test_a_bad_launch_flag_is_named_as_the_flag_not_a_temporary_file(flags, text, tmp_path, monkeypatch, capsys):
    from shardkit import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert cli.main(["launch", "--dry-run", *flags, "train.py"]) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(text, err), err
    assert "shardkit_launch_" not in err and ".yaml" not in err


def test_a_wrap_class_missing_from_the_model_lists_its_classes_closest_first():
    from torch import nn

    from shardkit.strategies.activation_checkpointing import resolve_module_classes

    class LlamaDecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)

    model = nn.Sequential(nn.Embedding(3, 2), nn.ModuleList([LlamaDecoderLayer()]), nn.LayerNorm(2))
    with pytest.raises(ValueError, match="no module of class 'LlamaDecoderLayers'.*did you mean 'LlamaDecoderLayer'"
                                         ".*closest first: LlamaDecoderLayer, ") as err:
        resolve_module_classes("LlamaDecoderLayers", model, "FSDP auto_wrap")
    for name in ("Embedding", "ModuleList", "LayerNorm", "Linear", "Sequential"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="closest first: .*LlamaDecoderLayer"):  # listed even when none is near
        resolve_module_classes("BertLayer", model, "FSDP auto_wrap")


def test_use_deepspeed_alone_is_no_launch(monkeypatch):
    # Accelerate's Accelerator(deepspeed_plugin=...) leaves ACCELERATE_USE_DEEPSPEED=true in its process; accelerate
    # launch also writes ACCELERATE_CONFIG_DS_FIELDS. The first alone must not turn a later shardkit front to DeepSpeed.
    assert launch_environment("no", {"ACCELERATE_USE_DEEPSPEED": "true"}) is None
    launched = launch_environment("no", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_CONFIG_DS_FIELDS": "",
                                         "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})
    assert launched is not None and launched.kind == "DEEPSPEED"
