"""TrainingArguments as transformers 5 has them: names, defaults, normalisation, and every bad value refused
with the field named (issue 23 item 1, issue 30's ranges)."""

import math
import warnings

import pytest
import torch

from shardkit.trainer import (
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    TrainingArgumentsError,
    UnknownArgumentError,
)
from shardkit.trainer.enums import DebugOption, HubStrategy, IntervalStrategy


def test_hf_defaults_and_normalisation(tmp_path):
    args = TrainingArguments(output_dir=None, report_to=None)
    assert args.output_dir == "trainer_output" and args.report_to == []
    assert TrainingArguments(report_to=["none"]).report_to == [] and TrainingArguments(report_to="none").report_to == []
    assert TrainingArguments(output_dir="~/x").output_dir.startswith("/")
    args = TrainingArguments(str(tmp_path), use_cpu=True, include_num_input_tokens_seen=True,
                             debug="underflow_overflow", hub_strategy="end", torch_empty_cache_steps=3,
                             ddp_find_unused_parameters=True, ddp_timeout=60, local_rank=0, warmup_steps=0.25,
                             lr_scheduler_kwargs='{"power": 2.0}', restore_callback_states_from_checkpoint=True,
                             eval_use_gather_object=True, skip_memory_metrics=False, auto_find_batch_size=True,
                             enable_jit_checkpoint=True)
    assert args.dataloader_pin_memory is False and args.include_num_input_tokens_seen == "all"
    assert args.debug == [DebugOption.UNDERFLOW_OVERFLOW] and args.hub_strategy == HubStrategy.END == "end"
    assert args.train_batch_size == 8 and args.get_warmup_steps(10) == 3 and args.lr_scheduler_kwargs == {"power": 2.0}
    assert TrainingArguments(debug=None).debug == []


def test_enum_members_of_any_kind_are_taken_by_value():
    args = TrainingArguments(eval_strategy=IntervalStrategy.EPOCH, save_strategy="EPOCH")
    assert args.eval_strategy == "epoch" and args.save_strategy == "epoch" and args.do_eval
    from transformers.trainer_utils import IntervalStrategy as HFIntervalStrategy

    assert TrainingArguments(eval_strategy=HFIntervalStrategy.EPOCH, save_strategy="epoch").eval_strategy == "epoch"


def test_to_dict_is_plain_json():
    import dataclasses
    import json

    @dataclasses.dataclass
    class WithDtype(TrainingArguments):
        dtype: torch.dtype = torch.bfloat16

    data = WithDtype(eval_strategy="steps", hub_token="secret").to_dict()
    assert data["dtype"] == "bfloat16" and data["eval_strategy"] == "steps" and data["hub_token"] == "<HUB_TOKEN>"
    json.dumps(data)


@pytest.mark.parametrize("kwargs,field", [
    (dict(learning_rate=math.nan), "learning_rate"), (dict(learning_rate=math.inf), "learning_rate"),
    (dict(learning_rate="abc"), "learning_rate"), (dict(max_grad_norm=math.nan), "max_grad_norm"),
    (dict(adam_beta1=1.5), "adam_beta1"), (dict(adam_beta2=1.0), "adam_beta2"), (dict(adam_epsilon=-1), "adam_epsilon"),
    (dict(weight_decay=math.nan), "weight_decay"), (dict(gradient_accumulation_steps=2.5), "gradient_accumulation"),
    (dict(dataloader_num_workers=-1), "dataloader_num_workers"), (dict(max_time=math.nan), "max_time"),
    (dict(save_steps=math.nan), "save_steps"), (dict(optim="adamw_bogus"), "optim"),
    (dict(torch_empty_cache_steps=1.0), "torch_empty_cache_steps"), (dict(torch_empty_cache_steps=0), "torch_empty"),
    (dict(logging_steps=10.5), "logging_steps"), (dict(warmup_steps=-1), "warmup_steps"),
    (dict(dataloader_prefetch_factor=2), "dataloader_num_workers"),
    (dict(fp16_full_eval=True, bf16_full_eval=True), "full_eval"),
    (dict(lr_scheduler_type="greedy"), "eval_strategy"),
    (dict(save_strategy="best"), "metric_for_best_model` must be provided"),
    (dict(accelerator_config={"split_batches": True}), "split_batches"),
    (dict(optim="stable_adamw"), "torch-optimi"),
    (dict(report_to="comet_ml"), "register_reporter"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(TrainingArgumentsError, match=field):
        TrainingArguments(output_dir="out", **kwargs)


def test_clipping_off_and_ratios_are_accepted():
    assert TrainingArguments(max_grad_norm=0).max_grad_norm == 0
    assert TrainingArguments(logging_steps=0.5).logging_steps == 0.5


def test_typos_and_obsolete_names_name_the_fix():
    with pytest.raises(UnknownArgumentError, match="did you mean 'learning_rate'"):
        TrainingArguments(learning_rte=1e-3)
    with pytest.raises(UnknownArgumentError, match="eval_strategy"):
        TrainingArguments(evaluation_strategy="epoch")
    with pytest.raises(TypeError, match="output_dir is written whatever it holds"):
        TrainingArguments(overwrite_output_dir=True)
    with pytest.raises(ValueError, match="warmup_steps=0.1"):
        TrainingArguments(warmup_ratio=0.1)
    with pytest.warns(FutureWarning, match="activation_checkpointing"):
        args = TrainingArguments(gradient_checkpointing=True)
    assert args.activation_checkpointing and args.gradient_checkpointing
    with pytest.raises(UnknownArgumentError, match="processing_class"):
        Trainer(torch.nn.Linear(2, 2), TrainingArguments(), tokenizer=object())
    with pytest.raises(UnknownArgumentError, match="did you mean 'callbacks'"):
        Trainer(torch.nn.Linear(2, 2), TrainingArguments(), callback=[])


def test_command_line_names_what_replaced_a_removed_flag():
    parser = HfArgumentParser(TrainingArguments)
    with pytest.raises(ValueError, match="--evaluation_strategy: it was renamed eval_strategy"):
        parser.parse_args_into_dataclasses(["--output_dir", "o", "--evaluation_strategy", "epoch"])
    with pytest.raises(ValueError, match="did you mean '--learning_rate'"):
        parser.parse_args_into_dataclasses(["--lerning_rate", "1"])
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "o", "--eval_strategy", "epoch",
                                                  "--include_num_input_tokens_seen", "true"])
    assert args.eval_strategy == "epoch" and args.include_num_input_tokens_seen == "all"


def test_process_log_levels_per_replica(monkeypatch):
    args = TrainingArguments(log_level="info", log_level_replica="error")
    assert args.get_process_log_level() == 20
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert args.get_process_log_level() == 40 and not args.should_save
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TrainingArguments(log_level="passive").get_process_log_level() > 0
