"""Small models and datasets for the Trainer tests: a two-parameter regression and a tiny HF Llama."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch import nn


class Regression(torch.utils.data.Dataset):
    """``y = 2x + 3`` plus noise, as dict samples (``input_x``, ``labels``)."""

    def __init__(self, length: int = 64, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=length).astype(np.float32)
        self.y = (2 * self.x + 3 + rng.normal(scale=0.1, size=length)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_x": self.x[i], "labels": self.y[i]}


class Line(nn.Module):
    """``a * x + b`` with a mean-squared-error loss; no num_items_in_batch (a micro-batch mean)."""

    def __init__(self, a: float = 0.0, b: float = 0.0):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.b = nn.Parameter(torch.tensor(b))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


def tiny_llama(seed: int = 0, vocab: int = 64):
    """A 2-layer Hugging Face Llama (hidden 16) built from a config: nothing downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences with labels equal to the inputs."""

    def __init__(self, length: int = 16, seq: int = 8, vocab: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (length, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def hf_trainer_checkpoint(folder: Path, max_steps: int = 2, schedule: str = "linear"):
    """``folder/hf/checkpoint-2`` written by Hugging Face's own Trainer (transformers is installed for the tests):
    the tiny Llama from seed 0 on ``Tokens()``, batch 4, lr 1e-2, AdamW, ``max_steps`` steps each logged. Returns
    the checkpoint's path and that Trainer (its ``state.log_history`` is the uninterrupted run)."""
    import transformers

    # A single-process ZeRO run earlier in this process leaves LOCAL_RANK=0 (DeepSpeed's zero.Init reads it);
    # HF's arguments would take it for a launcher's and wait for a process group.
    with mock.patch.dict(os.environ):
        os.environ.pop("LOCAL_RANK", None)
        args = transformers.TrainingArguments(output_dir=str(folder / "hf"), per_device_train_batch_size=4,
                                              learning_rate=1e-2, optim="adamw_torch", max_steps=max_steps,
                                              save_steps=2, logging_steps=1, use_cpu=True, report_to="none",
                                              disable_tqdm=True, seed=0, lr_scheduler_type=schedule)
        hf = transformers.Trainer(tiny_llama(), args, train_dataset=Tokens())
        hf.train()
    return folder / "hf" / "checkpoint-2", hf


def logged_after(log_history: list[dict], step: int) -> list[tuple[int, float, float]]:
    """(step, loss, learning rate) of each logged training step after ``step``."""
    return [(h["step"], h["loss"], h["learning_rate"]) for h in log_history if "loss" in h and h["step"] > step]
