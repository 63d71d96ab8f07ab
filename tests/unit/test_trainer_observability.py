"""Issue 27 through the Trainer: report_to with shardkit.tracking's trackers, TFLOP/s and MFU in the logs,
async_save checkpoints that resume exactly, full_determinism, profile_steps."""

from __future__ import annotations

import csv
import json

import torch
from trainer_fixtures import logged_losses, text_data

from shardkit.models import Llama, LlamaConfig
from shardkit.trainer import Trainer, TrainingArguments

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16, dropout=0.1)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, learning_rate=1e-2, max_steps=6,
                logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, optim="adamw_torch",
                full_determinism=True)
    return TrainingArguments(**{**base, **kw})


def _llama():
    torch.manual_seed(1)
    return Llama(TINY)


def test_trainer_reports_mfu_to_csv_saves_in_the_background_and_profiles(tmp_path):
    args = _args(tmp_path, report_to=["csv", "jsonl"], save_strategy="steps", save_steps=2, async_save=True,
                 save_total_limit=2, profile_steps=(1, 2), run_name="run")
    trainer = Trainer(_llama(), args, train_dataset=text_data())
    trainer.train()
    assert torch.are_deterministic_algorithms_enabled()
    with open(tmp_path / "out" / "runs" / "run" / "metrics.csv", newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("loss")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(float(r["tflops"]) > 0 and 0 < float(r["mfu"]) for r in rows)
    # Background saves: published, rotated to the last two, each with its trainer_state.json of its own step.
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert (out / "runs" / "profile" / "trace.rank0.json").is_file()

    resumed = Trainer(_llama(), _args(tmp_path, max_steps=6), train_dataset=text_data())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    straight = Trainer(_llama(), _args(tmp_path / "straight"), train_dataset=text_data())
    straight.train()
    torch.use_deterministic_algorithms(False)
    assert logged_losses(resumed)[-2:] == logged_losses(straight)[-2:] == logged_losses(trainer)[-2:]
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)
