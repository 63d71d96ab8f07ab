"""Worker for test_seed_configs.py (top level so the spawned rank imports it): the DeepSpeed seed's configs, as the
page writes them, through shardkit's Trainer with default TrainingArguments on a tiny Llama."""

from __future__ import annotations

import torch
from trainer_fixtures import logged_losses, text_data

from shardkit.models.llama import Llama, LlamaConfig
from shardkit.trainer import Trainer, TrainingArguments

TINY = LlamaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, max_position=16)


def seed_config_worker(configs: list[str], output_dir: str) -> dict:
    """Train 4 steps under each config (no warmup, as TrainingArguments defaults); each one's logged losses."""
    out = {}
    for path in configs:
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=f"{output_dir}/{len(out)}", deepspeed=path, max_steps=4,
                                 per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                                 report_to="none", save_strategy="no", disable_tqdm=True)
        trainer = Trainer(model=Llama(TINY), args=args, train_dataset=text_data(8))
        trainer.train()
        out[path] = logged_losses(trainer)
    return out
