"""Tiny tokenizer, model and fixed rollouts for tests/rl (CPU, fp32, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

PROMPTS = ["The old house stood", "She opened the letter and"]
G = 4  # completions per prompt


@pytest.fixture(scope="session")
def tokenizer():
    from shardkit.sft.chat import train_tokenizer

    text = Path(__file__).resolve().parents[2] / "examples" / "data" / "public_domain.txt"
    tok = train_tokenizer([text], vocab_size=300)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def fixed_completions(tokenizer, length: int = 6) -> tuple[list[list[int]], list[bool]]:
    """G completions per prompt of different lengths; some end with EOS, the others are cut at ``length``."""
    gen = torch.Generator().manual_seed(1)
    eos = tokenizer.eos_token_id
    ids, truncated = [], []
    for i in range(len(PROMPTS) * G):
        n = 2 + (i * 3) % (length - 1)
        row = torch.randint(5, len(tokenizer) - 1, (n,), generator=gen).tolist()
        row = [t for t in row if t != eos and t != tokenizer.pad_token_id][:n] or [7]
        if i % 3 != 2 and len(row) < length:
            row = row + [eos]
            truncated.append(False)
        else:
            row = (row + [9] * length)[:length]
            truncated.append(True)
        ids.append(row)
    return ids, truncated


def reward_length(completion_ids, **kwargs):
    return [float(len(c) % 3) for c in completion_ids]


def reward_first(completion_ids, **kwargs):
    # None for one completion: TRL's "this function does not apply" (NaN, left out of its statistics)
    return [None if i == 1 else float(c[0] % 5) / 2 for i, c in enumerate(completion_ids)]
