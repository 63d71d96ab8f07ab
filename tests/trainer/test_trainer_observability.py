"""Issue 27 through the Trainer: tokens/s, TFLOP/s and MFU in the reporters' logs (not in log_history),
async_save checkpoints that resume exactly, profile_steps."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from trainer_fixtures import logged_losses, text_data

from shardkit.models import Llama, LlamaConfig
from shardkit.trainer import Trainer, TrainingArguments, TrainingArgumentsError

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16, dropout=0.1)
HF_KEYS = {"loss", "grad_norm", "learning_rate", "epoch", "step"}


@pytest.fixture
def deterministic():
    yield
    torch.use_deterministic_algorithms(False)  # full_determinism is process-wide: the next tests run without it


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2, max_steps=6,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch",
                full_determinism=True)
    return TrainingArguments(**{**base, **kw})


def _llama():
    torch.manual_seed(1)
    return Llama(TINY)


def test_mfu_in_the_reports_background_saves_resume_exactly_and_steps_are_profiled(tmp_path, deterministic):
    args = _args(tmp_path, report_to=["csv", "jsonl"], save_strategy="steps", save_steps=2, async_save=True,
                 save_total_limit=2, profile_steps=(1, 2), run_name="run")
    trainer = Trainer(_llama(), args, train_dataset=text_data())
    trainer.train()
    with open(tmp_path / "out" / "runs" / "run" / "metrics.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(float(r["train/tflops"]) > 0 and float(r["train/mfu"]) > 0 and float(r["train/tokens_per_s"]) > 0
               for r in rows)
    # The rates are timing: log_history keeps Hugging Face's keys, so a resumed history equals the whole run's.
    assert all(set(h) <= HF_KEYS for h in trainer.state.log_history[:-1])
    # Background saves: published, rotated to the last two, each with Hugging Face's files and the
    # trainer_state.json of its own step; no staging folder left.
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert not list(out.glob(".checkpoint-*"))
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert (out / "checkpoint-4" / "model.safetensors").is_file()
    assert (out / "runs" / "profile" / "trace.rank0.json").is_file()

    resumed = Trainer(_llama(), _args(tmp_path), train_dataset=text_data())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    straight = Trainer(_llama(), _args(tmp_path / "straight"), train_dataset=text_data())
    straight.train()
    assert logged_losses(resumed)[-2:] == logged_losses(straight)[-2:] == logged_losses(trainer)[-2:]
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)


def test_a_bad_profile_range_is_named_when_the_arguments_are_built(tmp_path):
    with pytest.raises(TrainingArgumentsError, match="profile_steps=.*not a step range"):
        TrainingArguments(output_dir=str(tmp_path), profile_steps="two")
    with pytest.raises(TrainingArgumentsError, match="profile_steps"):
        TrainingArguments(output_dir=str(tmp_path), profile_steps=(4, 2))
