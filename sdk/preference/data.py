"""Preference data: prompt/chosen/rejected rows tokenized, and batched for one forward of chosen and rejected.

Rows are TRL's: ``prompt``, ``chosen`` and ``rejected`` as text (standard: an EOS token ends each completion) or
as message lists (conversational: rendered with the tokenizer's chat template, the prompt with the generation
prompt); without ``prompt``, a conversation's prompt is the messages that chosen and rejected share. Already
tokenized rows (``prompt_ids``, ``chosen_ids``, ``rejected_ids``) are taken as they are. The completion starts
where the tokenized prompt and prompt+completion part (as TRL: the shorter common prefix of the two).

A row that cannot train raises a ValueError naming its index and field: a missing or empty ``chosen``/``rejected``,
a completion that tokenizes to nothing, a prompt that fills ``max_length`` (TRL drops such rows silently).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from shardkit.sft.chat import CHAT_TEMPLATES, bounded_render, check_messages
from shardkit.sft.dataset import common_prefix

__all__ = ["DataCollatorForPreference", "PreferenceTokenizer", "tokenize_preference_dataset"]

logger = logging.getLogger("shardkit.preference")

TOKENIZED = ("prompt_ids", "chosen_ids", "rejected_ids")
REFERENCE = ("ref_chosen_logps", "ref_rejected_logps")
TRUNCATION_MODES = ("keep_start", "keep_end")
_BUILT_IN = frozenset(CHAT_TEMPLATES.values())


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0)


class PreferenceTokenizer:
    """One row in, ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` out (picklable, for ``Dataset.map``).

    Args:
        tokenizer: a Hugging Face tokenizer (with a chat template for conversational rows).
        max_length: the collator's row length; a prompt of ``max_length`` tokens or more is refused under
            ``keep_start`` (it would leave no completion token).
        truncation_mode: ``"keep_start"`` or ``"keep_end"``.
    """

    def __init__(self, tokenizer: Any, max_length: int | None = None, truncation_mode: str = "keep_start"):
        self.tokenizer, self.max_length, self.truncation_mode = tokenizer, max_length, truncation_mode

    def __call__(self, row: Mapping[str, Any], index: int) -> dict[str, Any]:
        if not isinstance(row, Mapping):
            raise ValueError(f"preference data, row {index}: a row is a dict of fields, got {type(row).__name__}")
        if all(k in row for k in TOKENIZED):
            out = {k: list(row[k]) for k in TOKENIZED}
        else:
            out = self._tokenize(row, index)
        for field in ("chosen_ids", "rejected_ids"):
            if not out[field]:
                raise ValueError(f"preference data, row {index}, field {field.removesuffix('_ids')!r}: the completion "
                                 "is empty (no token to score); drop the row or give it a completion")
        if self.max_length is not None and self.truncation_mode == "keep_start" and \
                len(out["prompt_ids"]) >= self.max_length:
            raise ValueError(f"preference data, row {index}, field 'prompt': the prompt is {len(out['prompt_ids'])} "
                             f"tokens, which fills max_length={self.max_length} and leaves no completion token; "
                             "raise max_length, shorten the prompt, or drop the row")
        for key in REFERENCE:
            if key in row:
                out[key] = float(row[key])
        return out

    def _tokenize(self, row: Mapping[str, Any], index: int) -> dict[str, list[int]]:
        for field in ("chosen", "rejected"):
            if field not in row:
                raise ValueError(f"preference data, row {index}: field {field!r} is missing (a row has 'prompt', "
                                 f"'chosen' and 'rejected'; it has {sorted(row)})")
            if _empty(row[field]):
                raise ValueError(f"preference data, row {index}, field {field!r}: the completion is empty")
        chosen, rejected = row["chosen"], row["rejected"]
        conversational = isinstance(chosen, list)
        if conversational != isinstance(rejected, list):
            raise ValueError(f"preference data, row {index}: 'chosen' and 'rejected' must both be text or both be "
                             "message lists")
        prompt = row.get("prompt")
        try:
            if conversational:
                check_messages(chosen, "chosen")
                check_messages(rejected, "rejected")
                if prompt is None:
                    shared = 0
                    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                        shared += 1
                    prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
                check_messages(prompt, "prompt")
                prompt_ids = self._chat(prompt, add_generation_prompt=True)
                chosen_full, rejected_full = self._chat(prompt + chosen), self._chat(prompt + rejected)
            else:
                if not isinstance(prompt, str):
                    raise ValueError("field 'prompt' is missing or not text (text rows need an explicit prompt)")
                if not isinstance(chosen, str) or not isinstance(rejected, str):
                    raise ValueError("'chosen' and 'rejected' must be text")
                eos = self.tokenizer.eos_token or ""
                chosen = chosen if chosen.endswith(eos) else chosen + eos
                rejected = rejected if rejected.endswith(eos) else rejected + eos
                prompt_ids = self._text(prompt)
                chosen_full, rejected_full = self._text(prompt + chosen), self._text(prompt + rejected)
        except (ValueError, TypeError) as err:
            raise ValueError(f"preference data, row {index}: {err}") from err
        start = min(common_prefix(prompt_ids, chosen_full), common_prefix(prompt_ids, rejected_full))
        if start < len(prompt_ids):
            logger.warning("preference data, row %d: the prompt tokenizes differently alone and followed by its "
                           "completion; the completion starts at token %d (the common prefix)", index, start)
        return {"prompt_ids": prompt_ids[:start], "chosen_ids": chosen_full[start:],
                "rejected_ids": rejected_full[start:]}

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _chat(self, messages: list, **kwargs: Any) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("conversational rows need a chat template: set tokenizer.chat_template (e.g. "
                             "shardkit.sft.set_chat_template(tokenizer, 'chatml'))")
        guard = nullcontext() if template in _BUILT_IN else bounded_render()
        with guard:
            out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
        return list(out["input_ids"])

    def batch(self, rows: Mapping[str, Sequence[Any]], indices: Sequence[int]) -> dict[str, list]:
        """``Dataset.map(batched=True, with_indices=True)``'s form."""
        out = [self({k: v[i] for k, v in rows.items()}, indices[i]) for i in range(len(indices))]
        return {k: [r[k] for r in out] for k in out[0]} if out else {k: [] for k in TOKENIZED}


def tokenize_preference_dataset(dataset: Any, tokenize: PreferenceTokenizer, num_proc: int | None = None,
                                name: str = "train") -> Any:
    """Tokenize a ``datasets.Dataset`` (with ``Dataset.map``) or a list / map-style dataset of dicts (into a list)."""
    if dataset is None:
        return None
    try:
        import datasets
    except ImportError:  # pragma: no cover
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.IterableDataset) or \
            (not hasattr(dataset, "__getitem__") and hasattr(dataset, "__iter__")):
        raise TypeError(f"the {name} dataset is streamed: preference trainers read a map-style dataset (a "
                        "datasets.Dataset or a list of dicts); take a part of the stream into one")
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        return dataset.map(tokenize.batch, batched=True, with_indices=True, num_proc=num_proc,
                           remove_columns=dataset.column_names, desc=f"Tokenizing the {name} preference dataset")
    return [tokenize(dataset[i], i) for i in range(len(dataset))]


class DataCollatorForPreference:
    """Tokenized rows -> one batch holding the chosen sequences, then the rejected ones.

    Padded: ``input_ids``/``attention_mask``/``completion_mask`` of ``2 x rows`` right-padded rows. Padding-free:
    one row of every sequence back to back with ``position_ids`` restarting at 0 per sequence (the attention stays
    inside each: shardkit's Llama, or a Hugging Face model on ``shardkit_varlen``/FlashAttention), plus
    ``packed_sequences`` (their lengths). Each sequence is truncated to ``max_length`` first.
    """

    def __init__(self, pad_token_id: int, max_length: int | None = None, truncation_mode: str = "keep_start",
                 padding_free: bool = False, pad_to_multiple_of: int | None = None):
        if truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode={truncation_mode!r} is not one of {list(TRUNCATION_MODES)}")
        self.pad_token_id, self.max_length, self.truncation_mode = pad_token_id, max_length, truncation_mode
        self.padding_free, self.pad_to_multiple_of = padding_free, pad_to_multiple_of

    def _cut(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        if self.max_length is None or len(ids) <= self.max_length:
            return ids, mask
        cut = slice(None, self.max_length) if self.truncation_mode == "keep_start" else slice(-self.max_length, None)
        return ids[cut], mask[cut]

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = []
        for field in ("chosen_ids", "rejected_ids"):
            for row in rows:
                prompt, completion = list(row["prompt_ids"]), list(row[field])
                sequences.append(self._cut(prompt + completion, [0] * len(prompt) + [1] * len(completion)))
        batch = self._flat(sequences) if self.padding_free else self._padded(sequences)
        for key in REFERENCE:
            if key in rows[0]:
                batch[key] = torch.tensor([float(r[key]) for r in rows], dtype=torch.float32)
        return batch

    def _flat(self, sequences: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        ids = [t for s, _ in sequences for t in s]
        mask = [m for _, c in sequences for m in c]
        positions = [p for s, _ in sequences for p in range(len(s))]
        return {"input_ids": torch.tensor([ids]), "completion_mask": torch.tensor([mask]),
                "position_ids": torch.tensor([positions]),
                "packed_sequences": torch.tensor([len(s) for s, _ in sequences])}

    def _padded(self, sequences: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(s) for s, _ in sequences)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        completion = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, (s, c) in enumerate(sequences):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            attention[i, :len(s)] = 1
            completion[i, :len(c)] = torch.tensor(c, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
