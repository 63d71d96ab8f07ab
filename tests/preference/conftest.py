"""Shared tiny model, tokenizer and preference rows for tests/preference (CPU, fp32, nothing downloaded)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

ROWS = [
    ("The old house stood", " on a hill above the town.", " under water."),
    ("She opened the letter and", " read it twice before smiling.", " ate it."),
    ("In the morning the fishermen", " pushed their boats into the grey sea.", " slept."),
    ("He asked the way to", " the station, and the boy pointed north.", " nowhere at all, then left."),
    ("The river ran", " fast and cold.", " upward into the clouds, singing loudly to the birds."),
    ("When the bell rang", " the children ran out into the yard.", " nothing."),
    ("A letter came", " from her brother in the city.", " from the moon."),
    ("The road was", " long.", " made of soup and very short and very strange."),
]


def rows(n: int = len(ROWS)) -> list[dict[str, str]]:
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS[:n]]


@pytest.fixture(scope="session")
def tokenizer():
    from shardkit.sft.chat import train_tokenizer

    text = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
    return train_tokenizer([text], vocab_size=300)


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


@pytest.fixture(scope="session")
def base_model(tokenizer):
    return tiny_llama(len(tokenizer))


@pytest.fixture
def model(base_model):
    return copy.deepcopy(base_model)
