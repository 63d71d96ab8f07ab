"""TrainingArguments: HF names and defaults, validation that names the fix, --flags and JSON/YAML files."""

import json
import os

import pytest
import torch

from shardkit.trainer import HfArgumentParser, TrainingArguments, TrainingArgumentsError, get_scheduler


def test_defaults_follow_hugging_face():
    args = TrainingArguments(output_dir="out")
    assert (args.per_device_train_batch_size, args.learning_rate, args.num_train_epochs) == (8, 5e-5, 3.0)
    assert args.optim == "adamw_torch_fused" and args.average_tokens_across_devices
    assert (args.lr_scheduler_type, args.save_strategy, args.eval_strategy, args.report_to) == ("linear", "steps",
                                                                                                 "no", [])
    assert args.logging_dir == "out/runs" and args.run_name == "out"


@pytest.mark.parametrize("kwargs,match", [
    (dict(load_best_model_at_end=True), "eval_strategy"),
    (dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=30, save_steps=100), "save_steps=90"),
    (dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps"), "save_strategy='epoch'"),
    (dict(eval_strategy="stpes"), "did you mean 'steps'"),
    (dict(lr_scheduler_type="cosin"), "did you mean 'cosine'"),
    (dict(fp16=True, bf16=True), "choose one"),
    (dict(save_strategy="best"), "metric_for_best_model"),
    (dict(warmup_ratio=1.5), "warmup_ratio"),
    (dict(fsdp="full_shard", deepspeed={"zero_optimization": {"stage": 2}}), "choose one engine"),
    (dict(lr_scheduler_type="reduce_lr_on_plateau"), "eval_strategy"),
])
def test_contradictions_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(output_dir="out", **kwargs)


def test_best_model_defaults_to_loss_lower_is_better():
    args = TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=10, save_steps=20)
    assert (args.metric_for_best_model, args.greater_is_better) == ("loss", False)
    args = TrainingArguments(metric_for_best_model="accuracy")
    assert args.greater_is_better is True


def test_flags_json_and_yaml(tmp_path):
    argv = ["--output_dir", "o", "--learning_rate", "0.1", "--fp16", "--gradient-accumulation-steps", "4",
            "--report_to", "jsonl", "--lr_scheduler_kwargs", '{"num_cycles": 2}', "--no_remove_unused_columns"]
    args = TrainingArguments.from_cli(argv)
    assert (args.learning_rate, args.fp16, args.gradient_accumulation_steps) == (0.1, True, 4)
    assert args.report_to == ["jsonl"] and args.lr_scheduler_kwargs == {"num_cycles": 2}
    assert args.remove_unused_columns is False
    (tmp_path / "a.json").write_text(json.dumps({"output_dir": "o", "max_steps": 7, "bf16": True}))
    (tmp_path / "a.yaml").write_text("output_dir: o\nmax_steps: 7\nbf16: true\n")
    for name in ("a.json", "a.yaml"):
        args = TrainingArguments.from_file(str(tmp_path / name))
        assert (args.max_steps, args.bf16) == (7, True)
    (tmp_path / "bad.yaml").write_text("output_dir: o\nlearning_rat: 1\n")
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        TrainingArguments.from_file(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="unknown command-line"):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--lerning_rate", "1"])


def test_tensorboard_without_the_package_names_it(monkeypatch):
    import sys

    from shardkit.trainer import Trainer

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if the package were not installed
    args = TrainingArguments(report_to="tensorboard")  # accepted, as Hugging Face's; the Trainer names the package
    with pytest.raises(ImportError, match="pip install tensorboard"):
        Trainer(torch.nn.Linear(2, 2), args)


@pytest.mark.parametrize("name,kwargs", [
    ("linear", {}), ("cosine", {}), ("cosine_with_restarts", {"num_cycles": 2}), ("polynomial", {"power": 2.0}),
    ("constant", {}), ("constant_with_warmup", {}), ("inverse_sqrt", {}), ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("warmup_stable_decay", {"num_decay_steps": 8}),
])
def test_schedules_match_transformers(name, kwargs):
    transformers = pytest.importorskip("transformers")

    def lrs(factory):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        sched = factory(opt)
        out = []
        for _ in range(30):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    ours = lrs(lambda o: get_scheduler(name, o, 5, 30, kwargs))
    theirs = lrs(lambda o: transformers.get_scheduler(name, o, num_warmup_steps=5, num_training_steps=30,
                                                      scheduler_specific_kwargs=dict(kwargs)))
    assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12)


def test_deepspeed_auto_values_come_from_the_arguments(tmp_path):
    from shardkit.config import resolve_runner_config
    from shardkit.trainer.engine import _ds_scheduler_type, _ds_scheduler_values

    args = TrainingArguments(learning_rate=3e-4, warmup_steps=5)
    for kind in ("WarmupLR", "WarmupDecayLR"):
        extra = {"total_num_steps": "auto"} if kind == "WarmupDecayLR" else {}
        ds = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "scheduler": {"type": kind, "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto", **extra}},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps(ds))
        values = _ds_scheduler_values(args, 100, 5, _ds_scheduler_type(str(path)))
        resolved = resolve_runner_config(str(path), gradient_accumulation_steps=2, micro_batch_size=8,
                                         optimizer_params={"lr": 3e-4}, scheduler_params=values)
        assert resolved.optimizer["params"]["lr"] == 3e-4
        assert resolved.scheduler["params"]["warmup_num_steps"] == 5
        assert resolved.scheduler["params"].get("total_num_steps", 100) == 100
        assert (resolved.gradient_accumulation_steps, resolved.micro_batch_size) == (2, 8)


def test_the_trainers_file_readers_refuse_oversized_and_garbage_files_by_name(tmp_path):
    """Arguments files, fsdp_config files, all_results.json and trainer_state.json go through the hostile-input-safe
    readers: a file over the cap is refused before it is read, and garbage names the file."""
    from shardkit.config.common import MAX_CONFIG_BYTES, ConfigError
    from shardkit.trainer.fsdp_config import read_fsdp_config_file
    from shardkit.trainer.metrics_io import write_metrics
    from shardkit.trainer.state import TrainerState, TrainerStateError

    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: over the cap without writing it
        f.truncate(MAX_CONFIG_BYTES + 1)
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b'{"output_dir": "o", \xff\xfe')
    for path in (huge, garbage):
        with pytest.raises(ConfigError, match=str(path.name)):
            HfArgumentParser(TrainingArguments).parse_json_file(path)
        with pytest.raises(TrainingArgumentsError, match=f"fsdp_config.*{path.name}"):
            read_fsdp_config_file(path)
    with pytest.raises(TrainingArgumentsError, match="fsdp_config"):
        TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", fsdp_config=str(garbage))
    out = tmp_path / "out"
    out.mkdir()
    (out / "all_results.json").write_text("[1, 2]")  # not an object: refused, not silently replaced
    with pytest.raises(ConfigError, match="all_results.json"):
        write_metrics(out, "eval", {"eval_loss": 1.0})
    assert (out / "all_results.json").read_text() == "[1, 2]"
    fifo = tmp_path / "trainer_state.json"
    os.mkfifo(fifo)  # would block a plain open(); refused without reading
    with pytest.raises(TrainerStateError, match="not a regular file"):
        TrainerState.load_from_json(fifo)
