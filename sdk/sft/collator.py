"""Batches of tokenized (and packed) sequences: right-padded rows, or padding-free single rows.

Every example is ``{"input_ids": [...], "labels": [...]}`` plus ``position_ids`` for packed rows (restarting at
0 with each sequence). ``labels`` are -100 where no loss is taken (prompt, user turns, padding, the first
token of a packed sequence).

- padded: one row per example, right-padded with the pad token (labels -100). Causal attention never lets a real
  token see the padding after it, so no attention mask is needed; one is added for models that take it (HF),
  except on packed rows, where the model reads the sequences from ``position_ids`` (Hugging Face builds its
  block-diagonal mask only when no attention mask is given). Packed rows are padded by continuing the last
  sequence's positions: the padding then only ever attends to tokens before it.
- padding-free: the whole micro-batch is one row, sequences end to end, ``position_ids`` restarting per
  sequence; with ``flash_attn_kwargs`` also ``cu_seq_lens_q/k`` and ``max_length_q/k``, which Hugging Face's
  FlashAttention path takes as they are (no recomputation from the positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardkit.sft.packing import IGNORE_INDEX

__all__ = ["DataCollatorForLanguageModeling", "sequence_lengths", "split_sequences"]


def sequence_lengths(position_ids: Sequence[int]) -> list[int]:
    """Lengths of the sequences of one row: a new one starts wherever a position is not the previous one plus 1."""
    lengths, previous = [], None
    for p in position_ids:
        if previous is None or p != previous + 1:
            lengths.append(0)
        lengths[-1] += 1
        previous = p
    return lengths


def split_sequences(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """The token ids of every sequence in a collated packed batch, row by row, split where the positions restart
    (a packed row's padding stays with its last sequence)."""
    out = []
    for ids, positions in zip(batch["input_ids"].tolist(), batch["position_ids"].tolist()):
        start = 0
        for n in sequence_lengths(positions):
            out.append(tuple(ids[start:start + n]))
            start += n
    return out


def _starts(position_ids: Sequence[int]) -> list[int]:
    """Offsets in the row where a sequence starts."""
    starts, offset = [], 0
    for n in sequence_lengths(position_ids):
        starts.append(offset)
        offset += n
    return starts


def _as_list(value: Any) -> list[int]:
    return value.tolist() if hasattr(value, "tolist") else list(value)


class DataCollatorForLanguageModeling:
    """TRL's collator name: turns tokenized examples into a batch for causal-LM training.

    Args:
        pad_token_id: the padding token (padded mode).
        padding_free: concatenate the batch into one row (see module docstring).
        pad_to_multiple_of: round the padded length up to a multiple of this.
        attention_mask: emit ``attention_mask`` on padded, unpacked batches (for models whose forward takes it).
        flash_attn_kwargs: emit ``cu_seq_lens_q/k`` and ``max_length_q/k`` on padding-free batches (for Hugging Face
            models running FlashAttention).
    """

    def __init__(self, pad_token_id: int, padding_free: bool = False, pad_to_multiple_of: int | None = None,
                 attention_mask: bool = True, flash_attn_kwargs: bool = False):
        if pad_token_id is None:
            raise ValueError("DataCollatorForLanguageModeling needs pad_token_id: set tokenizer.pad_token (or "
                             "SFTConfig(pad_token=...))")
        self.pad_token_id = int(pad_token_id)
        self.padding_free = padding_free
        self.pad_to_multiple_of = pad_to_multiple_of
        self.attention_mask = attention_mask
        self.flash_attn_kwargs = flash_attn_kwargs

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [self._row(e) for e in examples]
        return self._flat(rows) if self.padding_free else self._padded(rows)

    @staticmethod
    def _row(example: dict[str, Any]) -> tuple[list[int], list[int], list[int] | None]:
        ids = _as_list(example["input_ids"])
        labels = _as_list(example["labels"]) if "labels" in example else list(ids)
        if len(labels) != len(ids):
            raise ValueError(f"an example has {len(ids)} input_ids but {len(labels)} labels")
        positions = _as_list(example["position_ids"]) if "position_ids" in example else None
        if positions is not None and len(positions) != len(ids):
            raise ValueError(f"an example has {len(ids)} input_ids but {len(positions)} position_ids")
        return ids, labels, positions

    def _flat(self, rows: list[tuple[list[int], list[int], list[int] | None]]) -> dict[str, torch.Tensor]:
        ids, labels, positions, lengths = [], [], [], []
        for row_ids, row_labels, row_positions in rows:
            row_positions = row_positions if row_positions is not None else list(range(len(row_ids)))
            start = len(labels)
            ids.extend(row_ids)
            labels.extend(row_labels)
            positions.extend(row_positions)
            for first in _starts(row_positions):
                labels[start + first] = IGNORE_INDEX  # never predict a sequence's first token from the one before
            lengths.extend(sequence_lengths(row_positions))
        batch = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
                 "position_ids": torch.tensor([positions])}
        if self.flash_attn_kwargs:
            cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        return batch

    def _padded(self, rows: list[tuple[list[int], list[int], list[int] | None]]) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = any(p is not None for _, _, p in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (row_ids, row_labels, row_positions) in enumerate(rows):
            n = len(row_ids)
            ids[r, :n] = torch.tensor(row_ids, dtype=torch.long)
            labels[r, :n] = torch.tensor(row_labels, dtype=torch.long)
            mask[r, :n] = 1
            if packed:
                row_positions = row_positions if row_positions is not None else list(range(n))
                last = row_positions[-1] + 1 if n else 0
                positions[r] = torch.tensor(row_positions + list(range(last, last + width - n)), dtype=torch.long)
                labels[r, _starts(row_positions)] = IGNORE_INDEX
        batch = {"input_ids": ids, "labels": labels}
        if packed:
            batch["position_ids"] = positions
        elif self.attention_mask:
            batch["attention_mask"] = mask
        return batch
