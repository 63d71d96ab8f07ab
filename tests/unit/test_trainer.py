"""Trainer on one process: loss trace equals a hand-written Runner loop, exact accumulation, exact resume,
best-model selection with save_total_limit, early stopping, callback order, SIGTERM save."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from trainer_fixtures import GradCatcher, LogitsOnly, StopAt, SumLossLM, VarLen, logged_losses, pad_collate, text_data

from shardkit import FP32, Runner, SingleDevice
from shardkit.models import Llama, LlamaConfig
from shardkit.trainer import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments
from shardkit.trainer.callbacks import EVENTS

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16, dropout=0.1)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2,
                weight_decay=0.01, max_steps=8, logging_steps=1, save_strategy="no", disable_tqdm=True,
                lr_scheduler_type="linear", warmup_steps=2, seed=0, optim="adamw_torch")
    return TrainingArguments(**{**base, **kw})


def _llama():
    torch.manual_seed(1)
    return Llama(TINY)


def test_loss_trace_equals_a_hand_written_runner_loop(tmp_path):
    trainer = Trainer(_llama(), _args(tmp_path, gradient_accumulation_steps=2), train_dataset=text_data())
    trainer.train()
    # The same run by hand: same seeds, param groups (no decay on 1-d weights), schedule and clipping.
    runner = Runner(SingleDevice("cpu"), FP32(), gradient_accumulation_steps=2, seed=0)
    torch.manual_seed(0)
    model = _llama()
    torch.manual_seed(0)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: s / 2 if s < 2 else max(0.0, (8 - s) / 6))
    model, opt, sched = runner.setup(model, opt, sched)
    loader = runner.setup_dataloader(DataLoader(text_data(), batch_size=4, shuffle=True))
    losses, window = [], 0.0
    for batch in loader:
        loss = model(batch["input_ids"], batch["labels"])
        runner.backward(loss)
        window += loss.item() / 2
        if runner.sync_gradients:
            runner.clip_gradients(1.0)
            runner.step()
            losses.append(window)
            window = 0.0
            if len(losses) == 8:
                break
    assert logged_losses(trainer) == pytest.approx(losses, rel=1e-6)
    for (name, a), b in zip(trainer.model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("cls", [SumLossLM, LogitsOnly])
def test_accumulation_gives_the_big_batch_gradients(tmp_path, cls):
    data = VarLen(16)
    catcher = GradCatcher()
    args = _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=8, max_steps=1,
                 max_grad_norm=0.0, remove_unused_columns=False)
    Trainer(cls(), args, train_dataset=data, data_collator=pad_collate, callbacks=[catcher]).train()
    big = cls()
    batch = pad_collate([data[i] for i in range(16)])
    logits = big(batch["input_ids"]) if cls is LogitsOnly else None
    if logits is None:
        loss = big(**batch)
    else:
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 32), batch["labels"][:, 1:].reshape(-1),
                                           ignore_index=-100)
    loss.backward()
    for name, p in big.named_parameters():
        torch.testing.assert_close(catcher.grads[name], p.grad, rtol=1e-5, atol=1e-7)


def test_resume_true_continues_exactly(tmp_path):
    full = Trainer(_llama(), _args(tmp_path / "a", gradient_accumulation_steps=2, logging_steps=3),
                   train_dataset=text_data())
    full.train()
    args = _args(tmp_path / "b", gradient_accumulation_steps=2, logging_steps=3, save_strategy="steps", save_steps=5)
    first = Trainer(_llama(), args, train_dataset=text_data(), callbacks=[StopAt(5)])  # as a preempted job would
    first.train()
    torch.manual_seed(123)  # the resumed process starts with other RNG states: the checkpoint must restore them
    second = Trainer(_llama(), _args(tmp_path / "b", gradient_accumulation_steps=2, logging_steps=3,
                                     save_strategy="steps", save_steps=5), train_dataset=text_data())
    second.train(resume_from_checkpoint=True)
    assert logged_losses(second) == logged_losses(full)  # the log at step 6 averages steps 4-6 across the resume
    assert second.state.global_step == 8
    for (name, a), b in zip(second.model.named_parameters(), full.model.parameters()):
        assert torch.equal(a, b), name
    state = json.loads((tmp_path / "b" / "out" / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["global_step"] == 5


class Accuracy:
    def __call__(self, pred):
        logits, labels = pred
        return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}


def test_best_model_is_kept_and_loaded(tmp_path):
    args = _args(tmp_path, max_steps=12, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                 save_total_limit=1,
                 load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
                 learning_rate=3e-2)
    trainer = Trainer(_llama(), args, train_dataset=text_data(), eval_dataset=text_data(8), compute_metrics=Accuracy())
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    best = max(evals, key=lambda h: h["eval_loss"])  # "greater is better" on a falling loss: the first wins
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best['step']}")
    kept = sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*"))
    assert kept == [f"checkpoint-{best['step']}"]  # as transformers: save_total_limit=1 keeps the best alone at the end
    assert trainer.evaluate()["eval_loss"] == pytest.approx(best["eval_loss"], rel=1e-6)
    assert "eval_accuracy" in evals[0]


def test_early_stopping_stops_and_its_counter_is_saved(tmp_path):
    args = _args(tmp_path, max_steps=40, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                 metric_for_best_model="loss", greater_is_better=True, learning_rate=3e-2)
    trainer = Trainer(_llama(), args, train_dataset=text_data(), eval_dataset=text_data(8),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    trainer.train()
    assert trainer.state.global_step == 3  # the loss falls: steps 2 and 3 are not "better"
    state = json.loads((Path(args.output_dir) / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] == 2


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []


for _event in EVENTS:
    setattr(Recorder, _event, (lambda name: lambda self, *a, **k: self.events.append(name))(_event))


def test_callback_event_order(tmp_path):
    recorder = Recorder()
    args = _args(tmp_path, max_steps=2, gradient_accumulation_steps=2, logging_steps=2, eval_strategy="steps",
                 eval_steps=2, save_strategy="steps", save_steps=2)
    trainer = Trainer(_llama(), args, train_dataset=text_data(16), eval_dataset=text_data(4), callbacks=[recorder])
    trainer.train()
    step = ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
    expected = (["on_init_end", "on_train_begin", "on_epoch_begin"] + step + step
                + ["on_log", "on_prediction_step", "on_log", "on_evaluate", "on_save", "on_epoch_end", "on_log",
                   "on_train_end"])
    assert recorder.events == expected


class SigtermAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_and_resumes_exactly(tmp_path):
    full = Trainer(_llama(), _args(tmp_path / "a"), train_dataset=text_data())
    full.train()
    args = _args(tmp_path / "b")
    first = Trainer(_llama(), args, train_dataset=text_data(), callbacks=[SigtermAt(3)])
    first.train()
    assert first.state.global_step == 3
    assert (Path(args.output_dir) / "checkpoint-3" / "trainer_state.json").is_file()
    torch.manual_seed(7)
    second = Trainer(_llama(), _args(tmp_path / "b"), train_dataset=text_data())
    second.train(resume_from_checkpoint=True)
    assert logged_losses(first) == logged_losses(full)[:3]
    assert logged_losses(second) == logged_losses(full)  # log_history continues from the checkpoint
    for a, b in zip(second.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)


def test_resume_true_without_a_checkpoint_says_so(tmp_path):
    trainer = Trainer(_llama(), _args(tmp_path), train_dataset=text_data())
    with pytest.raises(ValueError, match="no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)


def test_jsonl_report_and_nan_filter(tmp_path, caplog):
    class NaNAt(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                trainer.losses.add(torch.tensor(float("nan")))  # a step whose loss was NaN

    args = _args(tmp_path, max_steps=3, logging_steps=3, report_to="jsonl")
    trainer = Trainer(_llama(), args, train_dataset=text_data(), callbacks=[NaNAt()])
    trainer.train()
    lines = [json.loads(x) for p in Path(args.logging_dir).glob("*.jsonl") for x in p.read_text().splitlines()]
    assert lines[0]["config"]["max_steps"] == 3  # the arguments first
    lines = lines[1:]
    assert lines[0]["step"] == 3 and lines[0]["loss"] == lines[0]["loss"]  # finite
    assert "NaN/inf" in caplog.text


def test_max_time_saves_and_stops(tmp_path):
    args = _args(tmp_path, max_time=1e-6)
    trainer = Trainer(_llama(), args, train_dataset=text_data())
    trainer.train()
    assert trainer.state.global_step == 1
    assert (Path(args.output_dir) / "checkpoint-1" / "trainer_state.json").is_file()


def test_predict_keeps_or_streams_every_sample_once(tmp_path):
    trainer = Trainer(_llama(), _args(tmp_path, per_device_eval_batch_size=3))
    kept = trainer.predict(text_data(7))
    assert kept.predictions.shape == (7, 16, 256) and kept.label_ids.shape == (7, 16)
    assert "test_loss" in kept.metrics
    streamed = trainer.predict(text_data(7), output_dir=tmp_path / "preds")
    import numpy as np

    parts = [np.load(p) for p in streamed.predictions]
    assert len(parts) == 3 and np.allclose(np.concatenate(parts), kept.predictions, atol=1e-6)
