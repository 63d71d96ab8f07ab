"""`shardkit launch` takes accelerate launch's config-as-flags (the Trainer seed's FSDP line) and reads the default
config `shardkit config` writes; a launcher config's mixed_precision yields to the training arguments' precision
with one warning (the FSDP seed's QLoRA recipe: mixed_precision 'no' in the YAML, --bf16 True on the command line)."""

from __future__ import annotations

import logging
import tempfile

import pytest
import yaml

from shardkit import cli
from shardkit.config import CONFIG_FILE_ENV, ConfigMismatchError, common
from shardkit.config.accelerate import load_accelerate_config
from shardkit.config.launch_flags import write_flags_config
from shardkit.precision import BF16

SEED_FLAGS = ["--num_processes=2", "--use_fsdp", "--mixed_precision=bf16",
              "--fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap=BertLayer",
              "--fsdp_sharding_strategy=1",
              "--fsdp_state_dict_type=FULL_STATE_DICT"]


def _launch_args(*argv: str):
    return cli.build_parser().parse_args(["launch", *argv])


def test_the_trainer_seeds_fsdp_flags_become_the_config_the_ranks_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run_glue.py").write_text("")
    args = _launch_args(*SEED_FLAGS, "run_glue.py", "--do_train")
    path = write_flags_config(args, None, 2)
    try:
        cfg = load_accelerate_config(path)
    finally:
        path.unlink()
    assert cfg.mixed_precision == "bf16" and cfg.num_processes == 2
    assert cfg.strategy == ("FSDP", {"sharding": "full", "auto_wrap": ("BertLayer",), "state_dict_type": "full",
                                     "cpu_offload": False, "activation_checkpointing": False,
                                     "sync_module_states": True})
    assert args.script_args == ["--do_train"]  # the script's own flags stay the script's
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert cli.main(["launch", "--dry-run", *SEED_FLAGS, "run_glue.py"]) == 0
    assert "--nproc-per-node=2" in capsys.readouterr().out
    assert not list(temp.iterdir())  # the written config is removed once the launch ends
    assert cli.main(["launch", "--dry-run", "--use_fsdp", "--fsdp_sharding_strategy=FUL_SHARD", "run_glue.py"]) == 2
    assert "FULL_SHARD" in capsys.readouterr().err  # refused by name, with the closest one


def test_launch_reads_the_default_config_that_shardkit_config_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert cli.main(["config", "--yes", "--distributed-type", "MULTI_CPU", "--num-processes", "2"]) == 0
    capsys.readouterr()
    assert cli.main(["launch", "--dry-run", "train.py"]) == 0
    out = capsys.readouterr()
    assert "--nproc-per-node=2" in out.out and "shardkit_config.yaml" in out.err


def test_training_arguments_precision_wins_over_the_launchers_config_with_one_warning(tmp_path, monkeypatch, caplog):
    from shardkit import Runner

    monkeypatch.setattr(common, "_WARNED", set())
    config = tmp_path / "qlora.yaml"
    config.write_text(yaml.safe_dump({"distributed_type": "NO", "mixed_precision": "no", "num_processes": 1}))
    with pytest.raises(ConfigMismatchError, match="mixed_precision"):  # given to the Runner itself: must agree
        Runner(precision=BF16(), config=str(config))
    monkeypatch.setenv(CONFIG_FILE_ENV, str(config))  # what `shardkit launch --config_file` hands the ranks
    with caplog.at_level(logging.WARNING, logger="shardkit.config"):
        runner = Runner(precision=BF16())
        Runner(precision=BF16())
    assert isinstance(runner.precision, BF16)
    warnings = [r.getMessage() for r in caplog.records if "is overridden by" in r.getMessage()]
    assert len(warnings) == 1 and "mixed_precision: no in" in warnings[0] and "BF16" in warnings[0], warnings
