"""Issue 13 N, O: every file of a corpus of bad configs gives a named error, from the Runner's reader and from
`shardkit launch --config_file` (one line naming the file and the key, exit code 2, no traceback).

The corpus lives in tests/faults/configs/: DeepSpeed JSON (ds_*) and Accelerate YAML (acc_*). The file
name says what is wrong; EXPECTED holds the key (or the problem) each message must name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardkit import cli
from shardkit.config import ConfigError, resolve_runner_config

CORPUS = Path(__file__).parent / "configs"
FILES = sorted(p for p in CORPUS.iterdir() if p.suffix in (".json", ".yaml"))

EXPECTED = {
    "acc_bad_type.yaml": "distributed_type", "acc_bad_yaml.yaml": "cannot parse",
    "acc_binary.yaml": "not UTF-8", "acc_ds_accum_zero.yaml": "gradient_accumulation_steps",
    "acc_ds_clip_negative.yaml": "gradient_clipping", "acc_ds_file_missing.yaml": "deepspeed_config_file",
    "acc_ds_file_number.yaml": "deepspeed_config_file", "acc_ds_stage_nine.yaml": "stage",
    "acc_dynamo_scalar.yaml": "dynamo_config", "acc_fsdp_section_scalar.yaml": "fsdp_config",
    "acc_fsdp_version_true.yaml": "fsdp_version", "acc_gpu_ids.yaml": "gpu_ids", "acc_latin1.yaml": "not UTF-8",
    "acc_machine_rank_negative.yaml": "machine_rank", "acc_megatron_scalar.yaml": "megatron_lm_config",
    "acc_min_params_zero.yaml": "fsdp_min_num_params", "acc_mixed_precision.yaml": "mixed_precision",
    "acc_no_with_two.yaml": "num_processes", "acc_not_a_mapping.yaml": "mapping",
    "acc_num_machines_string.yaml": "num_machines", "acc_num_processes_float.yaml": "num_processes",
    "acc_num_processes_nan.yaml": "num_processes", "acc_num_processes_zero.yaml": "num_processes",
    "acc_port_huge.yaml": "main_process_port", "acc_prefetch_list.yaml": "fsdp_backward_prefetch",
    "acc_python_tag.yaml": "python/object", "acc_sharding_bool.yaml": "fsdp_sharding_strategy",
    "acc_sharding_fraction.yaml": "fsdp_sharding_strategy", "acc_sharding_list.yaml": "fsdp_sharding_strategy",
    "acc_sharding_nine.yaml": "fsdp_sharding_strategy", "acc_state_dict_list.yaml": "fsdp_state_dict_type",
    "acc_tp_size_zero.yaml": "tp_size", "acc_unknown_key.yaml": "num_proceses",
    "ds_aio_queue_zero.json": "aio.queue_depth", "ds_auto_where_not_allowed.json": "zero_optimization.stage",
    "ds_batch_1e400.json": "train_batch_size", "ds_batch_fraction.json": "train_micro_batch_size_per_gpu",
    "ds_batch_infinity.json": "train_batch_size", "ds_batch_nan.json": "train_batch_size",
    "ds_batch_string.json": "gradient_accumulation_steps", "ds_batch_zero.json": "train_batch_size",
    "ds_betas_one.json": "optimizer.params.betas", "ds_betas_scalar.json": "optimizer.params.betas",
    "ds_bucket_infinity.json": "allgather_bucket_size", "ds_bucket_negative.json": "reduce_bucket_size",
    "ds_buffer_count_zero.json": "offload_param.buffer_count", "ds_clip_nan.json": "gradient_clipping",
    "ds_clip_negative.json": "gradient_clipping", "ds_cos_ratio_two.json": "cos_min_ratio",
    "ds_eps_zero.json": "optimizer.params.eps", "ds_latin1.json": "not UTF-8",
    "ds_live_params_negative.json": "stage3_max_live_parameters", "ds_loss_window_zero.json": "loss_scale_window",
    "ds_lr_negative.json": "optimizer.params.lr", "ds_lr_string.json": "optimizer.params.lr",
    "ds_min_loss_scale_zero.json": "min_loss_scale", "ds_not_a_mapping.json": "mapping",
    "ds_number_checkpoints_zero.json": "number_checkpoints", "ds_ratio_two.json": "offload_optimizer.ratio",
    "ds_scale_power_huge.json": "initial_scale_power", "ds_scale_power_negative.json": "initial_scale_power",
    "ds_section_not_mapping.json": "fp16", "ds_stage_seven.json": "zero_optimization.stage",
    "ds_stage_string.json": "zero_optimization.stage", "ds_steps_per_print_zero.json": "steps_per_print",
    "ds_total_steps_zero.json": "total_num_steps", "ds_truncated.json": "cannot parse",
    "ds_unknown_key.json": "gradient_cliping", "ds_utf16.json": "not UTF-8",
    "ds_warmup_steps_negative.json": "warmup_num_steps", "ds_weight_decay_nan.json": "weight_decay",
    # issue 30: a key written twice is refused by name (JSON and YAML readers keep the last one silently)
    "ds_duplicate_stage.json": "'stage' is written twice", "ds_duplicate_top_key.json": "train_micro_batch",
    "acc_duplicate_key.yaml": "second time on line 4",
    "acc_duplicate_nested_key.yaml": "'zero_stage' is written twice",
}


def test_every_corpus_file_has_an_expectation():
    assert sorted(EXPECTED) == [p.name for p in FILES]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_reader_names_the_file_and_the_key(path):
    with pytest.raises((ConfigError, NotImplementedError)) as info:
        resolve_runner_config(path, world_size=2)

    message = str(info.value)
    assert path.name in message and EXPECTED[path.name] in message


@pytest.mark.parametrize("path", [p for p in FILES if p.suffix == ".yaml"], ids=lambda p: p.name)
def test_cli_config_file_is_one_line_and_exit_code_2(path, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")

    code = cli.main(["launch", "--config_file", str(path), "--dry-run", str(script)])

    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert path.name in err and EXPECTED[path.name] in err


def test_corpus_count(capsys):
    named = 0
    for path in FILES:
        try:
            resolve_runner_config(path, world_size=2)
        except (ConfigError, NotImplementedError) as err:
            named += path.name in str(err)
    with capsys.disabled():
        print(f"\nconfig corpus: {named} of {len(FILES)} bad files gave a named error")
    assert named == len(FILES)
