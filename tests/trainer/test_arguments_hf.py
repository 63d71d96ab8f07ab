"""TrainingArguments as transformers 5 has them: names, defaults, normalisation, and every bad value refused
with the field named (issue 23 item 1, issue 30's ranges)."""

import dataclasses
import math
import shlex
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


# ---- transformers' own HfArgumentParser over shardkit's dataclasses ----------------------------------------


@dataclasses.dataclass
class ModelArguments:
    """The model/data half of an HF example script's parser (run_glue.py's and run_translation.py's names)."""

    model_name_or_path: str = "tiny"
    task_name: str | None = None
    max_seq_length: int = 128
    max_train_samples: int | None = None
    dataset_name: str | None = None
    dataset_config: str | None = None
    source_lang: str | None = None
    target_lang: str | None = None


@dataclasses.dataclass
class SFTScriptArguments:
    """ModelArguments beside SFTConfig, which holds `max_seq_length` itself (TRL's old name of max_length)."""

    model_name_or_path: str = "tiny"
    task_name: str | None = None
    max_train_samples: int | None = None
    dataset_name: str | None = None
    dataset_config: str | None = None
    source_lang: str | None = None
    target_lang: str | None = None


# The seed pages' command lines (Trainer page 000, FSDP page 002, DeepSpeed page 004), as written but for
# transformers 5's removed flags (`--overwrite_output_dir`, `--evaluation_strategy`: refused by both parsers,
# test_removed_flags_are_refused_by_both_parsers) and `{ds}`/`{out}` standing for files of the test.
SEED_COMMAND_LINES = {
    "trainer_run_glue": "--model_name_or_path google-bert/bert-base-cased --task_name mrpc --do_train --do_eval "
                        "--max_seq_length 128 --per_device_train_batch_size 16 --learning_rate 5e-5 "
                        "--num_train_epochs 3 --output_dir {out}/mrpc/",
    "trainer_log_levels": "--log_level warning --log_level_replica error --log_on_each_node 0",
    "trainer_log_errors": "--log_level error --log_level_replica error --log_on_each_node 0",
    "deepspeed_translation": "--deepspeed {ds} --model_name_or_path google-t5/t5-small --per_device_train_batch_size 1 "
                             "--output_dir {out} --fp16 --do_train --max_train_samples 500 --num_train_epochs 1 "
                             "--dataset_name wmt16 --dataset_config ro-en --source_lang en --target_lang ro",
    "deepspeed_eval": "--do_eval --deepspeed {ds}",
    "deepspeed_flags": "--gradient_checkpointing --tf32 --bf16 --bf16_full_eval --save_on_each_node "
                       "--lr_scheduler_type constant_with_warmup",
    "deepspeed_tf32_off": "--tf32 0 --fp16_full_eval --lr_scheduler_type linear",
    "fsdp_trainer": "--fsdp 'full_shard auto_wrap' --report_to none --eval_strategy epoch --save_strategy epoch",
    "fsdp_sft": "--seed 100 --num_train_epochs 1 --logging_steps 5 --log_level info --logging_strategy steps "
                "--eval_strategy epoch --save_strategy epoch --push_to_hub --hub_private_repo True "
                "--hub_strategy every_save --bf16 True --learning_rate 1e-4 --lr_scheduler_type cosine "
                "--weight_decay 1e-4 --warmup_steps 0.0 --max_grad_norm 1.0 --output_dir llama-sft-lora-fsdp "
                "--per_device_train_batch_size 8 --per_device_eval_batch_size 8 --gradient_accumulation_steps 4 "
                "--gradient_checkpointing True --report_to none",
}


def _seed_flags(name, tmp_path):
    ds = tmp_path / "ds_config_zero2.json"
    ds.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}')
    return shlex.split(SEED_COMMAND_LINES[name].format(ds=ds, out=tmp_path))  # as a shell splits them


def _both_parsers(types):
    from transformers import HfArgumentParser as TransformersParser

    return TransformersParser(types), HfArgumentParser(types)


@pytest.mark.parametrize("config", ["TrainingArguments", "SFTConfig"])
@pytest.mark.parametrize("name", sorted(SEED_COMMAND_LINES))
def test_transformers_parser_reads_the_seed_command_lines(tmp_path, name, config):
    from shardkit.sft import SFTConfig

    script, cls = {"TrainingArguments": (ModelArguments, TrainingArguments),
                   "SFTConfig": (SFTScriptArguments, SFTConfig)}[config]
    flags = _seed_flags(name, tmp_path)
    theirs, ours = _both_parsers((script, cls))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing's deprecation, said by both
        model_a, args_a = theirs.parse_args_into_dataclasses(flags)
        model_b, args_b = ours.parse_args_into_dataclasses(flags)
    assert type(args_a) is cls and model_a == model_b
    assert args_a.to_dict() == args_b.to_dict()


def test_transformers_parser_values(tmp_path):
    theirs, _ = _both_parsers((ModelArguments, TrainingArguments))
    _, args = theirs.parse_args_into_dataclasses(_seed_flags("fsdp_trainer", tmp_path))
    assert (args.fsdp, args.report_to, args.eval_strategy) == ("full_shard auto_wrap", [], "epoch")
    model, args = theirs.parse_args_into_dataclasses(_seed_flags("deepspeed_translation", tmp_path))
    assert args.deepspeed == str(tmp_path / "ds_config_zero2.json") and args.fp16 and args.do_train
    assert model.max_train_samples == 500 and model.dataset_config == "ro-en"
    with pytest.warns(FutureWarning, match="activation_checkpointing"):
        _, args = theirs.parse_args_into_dataclasses(_seed_flags("deepspeed_flags", tmp_path))
    assert args.gradient_checkpointing is True and args.tf32 is True and args.bf16 and args.bf16_full_eval
    assert args.lr_scheduler_type == "constant_with_warmup" and args.save_on_each_node
    _, args = theirs.parse_args_into_dataclasses(_seed_flags("deepspeed_tf32_off", tmp_path))
    assert args.tf32 is False and args.activation_checkpointing is False
    _, args = theirs.parse_args_into_dataclasses(["--report_to", "jsonl", "--profile_steps", "2-3", "--debug",
                                                  "underflow_overflow", "--optim_target_modules", "all-linear",
                                                  "--disable_tqdm", "--fsdp_config", '{"min_num_params": 100}'])
    assert args.report_to == ["jsonl"] and args.profile_steps == "2-3" and args.disable_tqdm is True
    assert args.debug == [DebugOption.UNDERFLOW_OVERFLOW] and args.optim_target_modules == "all-linear"
    assert args.fsdp_config == {"min_num_params": 100}


def test_transformers_parser_sft_fields(tmp_path):
    from transformers import HfArgumentParser as TransformersParser

    from shardkit.sft import SFTConfig

    flags = ["--packing", "--max_length", "64", "--dataset_text_field", "content", "--padding_free", "--dataset_kwargs",
             '{"add_special_tokens": false, "append_concat_token": false}', "--completion_only_loss", "false"]
    (config,) = TransformersParser(SFTConfig).parse_args_into_dataclasses(flags)
    assert (config.packing, config.max_length, config.dataset_text_field, config.padding_free) == (True, 64, "content",
                                                                                                   True)
    assert not config.add_special_tokens and not config.append_concat_token and config.completion_only_loss is False
    assert config.to_dict() == HfArgumentParser(SFTConfig).parse_args_into_dataclasses(flags)[0].to_dict()


@pytest.mark.parametrize("how", ["dict", "json", "yaml"])
def test_transformers_parser_files_and_dicts(tmp_path, how):
    import json

    import yaml

    values = {"output_dir": str(tmp_path), "fsdp": "full_shard auto_wrap", "report_to": "none", "bf16": True,
              "eval_strategy": "epoch", "gradient_checkpointing": True, "deepspeed": None, "tf32": False,
              "fsdp_config": {"min_num_params": 100}, "debug": "underflow_overflow", "model_name_or_path": "m"}
    theirs, ours = _both_parsers((ModelArguments, TrainingArguments))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if how == "dict":
            outputs = [parser.parse_dict(values) for parser in (theirs, ours)]
        else:
            path = tmp_path / f"args.{how}"
            path.write_text(json.dumps(values) if how == "json" else yaml.safe_dump(values))
            outputs = [getattr(parser, f"parse_{how}_file")(path) for parser in (theirs, ours)]
    (model_a, args_a), (model_b, args_b) = outputs
    assert model_a == model_b and model_a.model_name_or_path == "m"
    assert args_a.to_dict() == args_b.to_dict()
    assert (args_a.fsdp, args_a.report_to, args_a.bf16, args_a.eval_strategy) == ("full_shard auto_wrap", [], True,
                                                                                  "epoch")
    assert args_a.activation_checkpointing and args_a.fsdp_config == {"min_num_params": 100}


def test_removed_flags_are_refused_by_both_parsers(tmp_path):
    """transformers 5 dropped `--overwrite_output_dir` and `--evaluation_strategy`, which the pages still show:
    transformers' parser refuses them over its own TrainingArguments as over shardkit's."""
    from transformers import HfArgumentParser as TransformersParser
    from transformers import TrainingArguments as TransformersArguments

    for flag in (["--overwrite_output_dir"], ["--evaluation_strategy", "epoch"]):
        for cls in (TransformersArguments, TrainingArguments):
            with pytest.raises(ValueError, match="not used by the HfArgumentParser"):
                TransformersParser(cls).parse_args_into_dataclasses(["--output_dir", str(tmp_path), *flag])
        with pytest.raises(ValueError, match="removed|renamed|whatever it holds"):
            HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--output_dir", str(tmp_path), *flag])


# ---- the pages' scripts, ported with only the import changed, run with their flags ----------------------------

PORTED_SCRIPT = '''
import json
import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

from shardkit.trainer import Trainer, TrainingArguments  # the one line changed: was `from transformers import ...`


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "the checkpoint (here a tiny Llama is built locally)"})
    task_name: str | None = None
    max_seq_length: int = 16
    max_train_samples: int | None = None
    dataset_name: str | None = None
    dataset_config: str | None = None
    source_lang: str | None = None
    target_lang: str | None = None


class Repeated(torch.utils.data.Dataset):
    def __init__(self, length, seq):
        self.ids = torch.arange(seq) % 13 + 1
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return {"input_ids": self.ids, "labels": self.ids}


def main():
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, training_args = parser.parse_args_into_dataclasses()
    torch.manual_seed(training_args.seed)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    samples = min(model_args.max_train_samples or 32, 32)
    train = Repeated(samples, min(model_args.max_seq_length, 16))
    trainer = Trainer(model=model, args=training_args, train_dataset=train if training_args.do_train else None,
                      eval_dataset=Repeated(4, 16) if training_args.do_eval else None)
    if training_args.do_train:
        trainer.train()
        trainer.save_model()
    if training_args.do_eval:
        trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open(sys.argv[0] + ".result.json", "w") as out:
        json.dump({"losses": losses, "strategy": type(trainer.runner.strategy).__name__}, out)


if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("page", ["trainer_run_glue", "deepspeed_translation", "fsdp_run_glue"])
def test_ported_page_script_trains_under_transformers_parser(tmp_path, monkeypatch, page):
    """The Trainer page's run_glue command line (also with `--fsdp "full_shard auto_wrap"`) and the DeepSpeed
    page's run_translation one (ZeRO-2 from the `--deepspeed` file), as written, through transformers'
    HfArgumentParser in an HF-style script, in one process: the loss falls."""
    import json
    import runpy

    script = tmp_path / "run_script.py"
    script.write_text(PORTED_SCRIPT)
    flags = (_seed_flags("trainer_run_glue", tmp_path) + ["--fsdp", "full_shard auto_wrap"] if page == "fsdp_run_glue"
             else _seed_flags(page, tmp_path)) + ["--logging_steps", "1", "--save_strategy", "no"]
    monkeypatch.setattr("sys.argv", [str(script), *flags])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        runpy.run_path(str(script), run_name="__main__")
    result = json.loads((tmp_path / "run_script.py.result.json").read_text())
    assert result["strategy"] == {"trainer_run_glue": "SingleDevice", "deepspeed_translation": "ZeRO2",
                                  "fsdp_run_glue": "FSDP"}[page]
    losses = result["losses"]
    # every batch holds the same sequence: at the page's learning rate each step lowers the loss a little
    assert len(losses) >= 6 and all(b < a for a, b in zip(losses, losses[1:])), losses
