"""Batches as Hugging Face makes them, trainer.accelerator, the Hub seam, callbacks and the debug switches
(issue 23 item 1)."""

import logging

import pytest
import torch
from trainer_tiny import Line, Regression, tiny_llama

from shardkit.trainer import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    default_data_collator,
)
from shardkit.trainer.callbacks import EVENTS


def _args(tmp_path, **kw):
    return TrainingArguments(**{**dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=1,
                                       save_strategy="no", disable_tqdm=True), **kw})


def test_a_tokenized_datasets_split_gives_tensors_and_raw_text_is_named(tmp_path):
    import datasets

    ids = [[i % 64 for i in range(j, j + 6)] for j in range(8)]
    split = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids, "text": ["x"] * 8})
    trainer = Trainer(tiny_llama(), _args(tmp_path), train_dataset=split)
    batch = next(iter(trainer.get_train_dataloader()))
    assert isinstance(batch["input_ids"], torch.Tensor) and batch["input_ids"].shape == (2, 6)
    trainer.train()
    raw = datasets.Dataset.from_dict({"text": ["some words"] * 8})
    with pytest.raises(ValueError, match="No columns in the dataset match the model's forward method signature"):
        Trainer(tiny_llama(), _args(tmp_path), train_dataset=raw).train()
    rows = [{"label": 1, "x": [1.0, 2.0], "note": "s"}, {"label": 0, "x": [3.0, 4.0], "note": "t"}]
    batch = default_data_collator(rows)
    assert batch["labels"].dtype == torch.long and batch["x"].shape == (2, 2) and "note" not in batch


def test_accelerator_answers_or_names_the_runner(tmp_path):
    model = Line()
    trainer = Trainer(model, _args(tmp_path))
    accelerator = trainer.accelerator
    assert accelerator.is_main_process and accelerator.num_processes == 1 and accelerator.process_index == 0
    assert accelerator.device == trainer.runner.device and accelerator.distributed_type == "NO"
    assert accelerator.unwrap_model(torch.nn.DataParallel(model)) is model
    assert getattr(accelerator.state, "fsdp_plugin", None) is None and accelerator.mixed_precision == "no"
    assert not trainer.is_deepspeed_enabled and not trainer.is_fsdp_enabled and trainer.deepspeed is None
    with pytest.raises(AttributeError, match="trainer.runner"):
        accelerator.prepare(model)
    # The process facts are shardkit.Accelerator's own (accelerate_compat), read from the Trainer's strategy.
    from shardkit.accelerate_compat.state import ProcessFacts, distributed_type_of

    assert isinstance(accelerator, ProcessFacts)
    assert accelerator.distributed_type == distributed_type_of(trainer.runner.strategy)
    assert accelerator.on_main_process(lambda: "ran")() == "ran" and accelerator.is_last_process


def test_push_to_hub_uploads_output_dir_and_a_misspelt_hub_strategy_is_named(tmp_path, monkeypatch):
    from concurrent.futures import Future

    from shardkit.trainer.hub_pusher import HubPusher

    calls = []

    class RecordingApi:  # nothing reaches the Hub
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id))
            return None

        def upload_folder(self, **kwargs):
            calls.append(("upload_folder", kwargs))
            done: Future = Future()
            done.set_result("commit")
            return done

    monkeypatch.setattr(HubPusher, "api", property(lambda self: RecordingApi()))
    with pytest.raises(ValueError, match="every_save"):
        Trainer(Line(), _args(tmp_path, push_to_hub=True, hub_model_id="me/model", hub_strategy="every_sav"))
    Trainer(Line(), _args(tmp_path, push_to_hub=True, hub_model_id="me/model"))  # every_save: pushed at each save

    class Pushes(TrainerCallback):
        began = 0

        def on_push_begin(self, args, state, control, **kwargs):
            Pushes.began += 1

    trainer = Trainer(Line(), _args(tmp_path, hub_strategy="checkpoint", hub_model_id="me/model"), callbacks=[Pushes])
    assert trainer.push_to_hub() == "commit"
    assert Pushes.began == 1 and "on_push_begin" in EVENTS
    (_, upload), = [c for c in calls if c[0] == "upload_folder"]
    assert calls[0] == ("create_repo", "me/model") and upload["folder_path"] == trainer.args.output_dir
    assert upload["ignore_patterns"] == ["_*", "checkpoint-*"] and upload["commit_message"] == "End of training"


def test_callbacks_as_hugging_face_defines_them(caplog):
    class Counter(TrainerCallback, ExportableState):
        def __init__(self, name="a"):
            self.name, self.count = name, 0

        def state(self):
            return {"args": {"name": self.name}, "attributes": {"count": self.count}}

    restored = Counter.from_state({"args": {"name": "b"}, "attributes": {"count": 5}})
    assert (restored.name, restored.count) == ("b", 5)
    stopper = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.1)
    control = TrainerControl()

    class Args:
        greater_is_better = True

    stopper.check_metric_value(Args(), TrainerState(best_metric=0.8), control, 0.85)  # within the threshold
    assert stopper.early_stopping_patience_counter == 1
    with caplog.at_level(logging.WARNING, logger="shardkit.trainer"):
        handler = CallbackHandler([Counter, Counter], None, None, None, None)
    assert "Counter" in caplog.text and "DefaultFlowCallback" in caplog.text
    assert handler.callback_list == "Counter\nCounter"
    assert CallbackHandler([DefaultFlowCallback], None, None, None, None).pop_callback(Counter) is None


def test_debug_underflow_overflow_names_the_module(tmp_path):
    class Blows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(1, 1)

        def forward(self, input_x, labels=None):
            y = self.inner(input_x[:, None]) * float("inf")
            return (torch.nn.functional.mse_loss(y[:, 0], labels), y)

    trainer = Trainer(Blows(), _args(tmp_path, debug="underflow_overflow"), train_dataset=Regression(8))
    with pytest.raises(FloatingPointError, match="the model .Blows. holds inf or NaN"):
        trainer.train()


def test_memory_metrics_and_full_determinism(tmp_path):
    try:
        trainer = Trainer(Line(), _args(tmp_path, skip_memory_metrics=False, full_determinism=True),
                          train_dataset=Regression(8), eval_dataset=Regression(4))
        assert torch.are_deterministic_algorithms_enabled()
        metrics = trainer.train().metrics
        assert {"init_mem_cpu_alloc_delta", "train_mem_cpu_alloc_delta", "train_mem_cpu_peaked_delta"} <= set(metrics)
        assert "eval_mem_cpu_alloc_delta" in trainer.evaluate()
    finally:
        torch.use_deterministic_algorithms(False)


def test_parallel_degrees_come_from_the_strategy_mesh():
    """get_tp_size / get_cp_size (transformers reads them for batch arithmetic) report the strategy's mesh."""
    from types import SimpleNamespace

    from shardkit import DDP, ContextParallel, TensorParallel
    from shardkit.trainer import Trainer

    cases = [(ContextParallel(cp_size=2, tp_size=2), 2, 2), (ContextParallel(cp_size=4), 1, 4),
             (TensorParallel(tp_size=4), 4, 1), (DDP(), 1, 1)]
    for strategy, tp, cp in cases:
        trainer = SimpleNamespace(runner=SimpleNamespace(strategy=strategy))
        trainer._parallel_degree = lambda name, t=trainer: Trainer._parallel_degree(t, name)
        assert (Trainer.get_tp_size(trainer), Trainer.get_cp_size(trainer)) == (tp, cp), strategy


def _stream_rows(n=64):
    for i in range(n):  # counting from i: learnt in a few steps, and every batch differs from the next
        ids = [(t + i) % 13 + 1 for t in range(8)]
        yield {"input_ids": ids, "labels": ids}


class _TorchStream(torch.utils.data.IterableDataset):
    """A plain torch IterableDataset: no length, no state of its own."""

    def __iter__(self):
        return _stream_rows()


def _stream(kind):
    import datasets

    return datasets.IterableDataset.from_generator(_stream_rows) if kind == "datasets" else _TorchStream()


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("kind", ["datasets", "torch"])
def test_a_stream_trains_evaluates_and_resumes_with_default_arguments(tmp_path, kind):
    """Default arguments (train_sampling_strategy='random') over a stream: read in its own order, as Hugging
    Face's Trainer reads it; the epoch counts max_steps' batches; a resumed run's losses equal the whole run's."""
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
                logging_steps=1, save_steps=3, disable_tqdm=True)
    assert TrainingArguments(**args).train_sampling_strategy == "random"
    trainer = Trainer(tiny_llama(), TrainingArguments(**args), train_dataset=_stream(kind),
                      eval_dataset=_stream(kind))
    trainer.train()
    losses = _losses(trainer)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    assert [h["epoch"] for h in trainer.state.log_history if "loss" in h] == pytest.approx([k / 6 for k in range(1, 7)])
    assert trainer.evaluate()["eval_loss"] < losses[0]
    assert trainer.predict(_stream(kind)).predictions.shape[0] == 64
    results = []  # batch_eval_metrics: compute_result=True on the last batch, which a stream does not announce
    trainer.compute_metrics = lambda prediction, compute_result: results.append(compute_result) or {"n": 1.0}
    trainer.args.batch_eval_metrics = True
    trainer.evaluate()
    assert results == [False] * 7 + [True]

    resumed = Trainer(tiny_llama(), TrainingArguments(**args), train_dataset=_stream(kind))
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert _losses(resumed)[-3:] == pytest.approx(losses[3:], abs=1e-6)


def test_trainer_lines_follow_transformers_verbosity(tmp_path):
    """As Hugging Face's own tests look for them: "Running training" and the callback warnings on transformers'
    library logger, shown as its verbosity (or log_level, which sets it) says."""
    from transformers.testing_utils import CaptureLogger, LoggingLevel
    from transformers.utils import logging as hf_logging

    from shardkit.trainer import PrinterCallback

    library = hf_logging.get_logger()

    def train(**kw):
        with CaptureLogger(library) as captured:
            Trainer(Line(), _args(tmp_path, **kw), train_dataset=Regression(8)).train()
        return captured.out

    with LoggingLevel(logging.INFO):
        assert "Running training" in train()
        assert "Running training" not in train(log_level="error")
    with LoggingLevel(logging.WARNING):
        assert "Running training" not in train()
        assert "Running training" in train(log_level="info")
    with LoggingLevel(logging.WARNING), CaptureLogger(library) as captured:
        Trainer(Line(), _args(tmp_path), train_dataset=Regression(8), callbacks=[PrinterCallback, PrinterCallback])
    assert "PrinterCallback" in captured.out
    with LoggingLevel(logging.ERROR), CaptureLogger(library) as captured:
        Trainer(Line(), _args(tmp_path), train_dataset=Regression(8), callbacks=[PrinterCallback, PrinterCallback])
    assert captured.out == ""


def test_a_stream_whose_saved_position_is_refused_skips_the_trained_batches(tmp_path, caplog):
    """A checkpoint whose stream position does not fit this run (another data seed here) falls back to the
    position the step count gives, as for a map-style dataset: the batches trained are skipped from the stream's
    start, as Hugging Face skips them, and the resumed run's losses are the whole run's."""
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
                logging_steps=1, save_steps=3, disable_tqdm=True, data_seed=1)
    trainer = Trainer(tiny_llama(), TrainingArguments(**args), train_dataset=_stream("torch"))
    trainer.train()
    losses = _losses(trainer)
    resumed = Trainer(tiny_llama(), TrainingArguments(**{**args, "data_seed": 2}), train_dataset=_stream("torch"))
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert "cannot be restored exactly" in caplog.text
    assert _losses(resumed)[-3:] == pytest.approx(losses[3:], abs=1e-6)
