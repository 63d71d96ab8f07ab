"""Paired preference data for the reference-free trainers (ORPO, CPO/SimPO), tokenized as TRL's ``ORPOTrainer`` and
``CPOTrainer`` do, and their collator.

A row is ``prompt``, ``chosen``, ``rejected`` (text, or message lists rendered with the tokenizer's chat template),
or ``chosen``/``rejected`` holding the whole conversation (the prompt is their common start). As TRL:

- the prompt and each answer are tokenized without special tokens; an answer's tokens are those of
  ``prompt + answer`` past the prompt's (one fewer when the tokenizer merged the prompt's last token into the
  answer), a BOS token starts each sequence and an EOS token ends each answer when missing;
- a sequence longer than ``max_length`` loses the end of its answer, never its prompt;
- labels are the sequence with the prompt's positions set to -100.

Rows that cannot be trained on raise a ValueError naming the row and the field: a missing field, an empty answer,
a prompt that alone fills ``max_length`` (TRL trains on an empty answer there), text beside messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from shardkit.preference.kto_data import split_implicit_prompt
from shardkit.sft.chat import CHAT_TEMPLATES, bounded_render, check_messages

__all__ = ["DataCollatorForPairs", "PairTokenizer", "prepare_pair_dataset", "render_pair"]

IGNORE_INDEX = -100
_BUILT_IN = frozenset(CHAT_TEMPLATES.values())
_FIELDS = ("prompt", "chosen", "rejected")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and "role" in value[0]


def _common_chars(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def render_pair(row: Mapping[str, Any], tokenizer: Any) -> dict[str, str]:
    """A conversational pair as text, as TRL's ``maybe_apply_chat_template`` renders it: the prompt with the
    generation prompt (or continuing a final assistant message), each answer as the rest of the whole conversation
    after the prompt's text (the prompt cut to what the conversations share)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("conversational rows need a chat template: set tokenizer.chat_template")
    prompt_messages = row["prompt"]
    last_role = prompt_messages[-1]["role"]
    if last_role not in ("user", "tool", "assistant"):
        raise ValueError(f"the prompt's last message has role {last_role!r}: it must be 'user', 'tool' or "
                         "'assistant'")
    kwargs = dict(row.get("chat_template_kwargs") or {})
    tools = row.get("tools") or None
    guard = nullcontext() if template in _BUILT_IN else bounded_render()
    with guard:
        prompt = tokenizer.apply_chat_template(prompt_messages, tools=tools, tokenize=False,
                                               add_generation_prompt=last_role != "assistant",
                                               continue_final_message=last_role == "assistant", **kwargs)
        whole = {k: tokenizer.apply_chat_template(prompt_messages + row[k], tools=tools, tokenize=False, **kwargs)
                 for k in ("chosen", "rejected")}
    for k in ("chosen", "rejected"):
        prompt = _common_chars(prompt, whole[k])
    return {"prompt": prompt, "chosen": whole["chosen"][len(prompt):], "rejected": whole["rejected"][len(prompt):]}


class PairTokenizer:
    """Tokenizes one pair into ``chosen_*``/``rejected_*`` ``input_ids``, ``attention_mask`` and ``labels``
    (picklable, for ``Dataset.map(num_proc=...)``).

    Args:
        tokenizer: a Hugging Face tokenizer.
        max_length: tokens per sequence (the answer is cut to fit).
        trainer: the trainer's name, for messages.
        name: "train"/"eval", for messages.
    """

    def __init__(self, tokenizer: Any, max_length: int, trainer: str = "ORPO", name: str = "train"):
        self.tokenizer, self.max_length, self.trainer, self.name = tokenizer, max_length, trainer, name

    def _where(self, index: int, field: str) -> str:
        return f"{self.trainer} data, {self.name} row {index}, field {field!r}"

    def _text_row(self, row: Mapping[str, Any], index: int) -> dict[str, str]:
        for field in ("chosen", "rejected"):
            if field not in row or row[field] is None:
                raise ValueError(f"{self._where(index, field)}: the row has no {field!r} (pairs need 'prompt', "
                                 "'chosen' and 'rejected', or 'chosen' and 'rejected' holding the whole "
                                 "conversation)")
            if not row[field]:
                raise ValueError(f"{self._where(index, field)}: {field!r} is empty; drop the row or give it the "
                                 "answer")
        chosen_kind = _is_messages(row["chosen"])
        if chosen_kind != _is_messages(row["rejected"]):
            raise ValueError(f"{self._where(index, 'rejected')}: 'chosen' and 'rejected' must both be text or both "
                             "message lists")
        prompt = row.get("prompt")
        if prompt is None or _is_messages(prompt) != chosen_kind:
            prompt, chosen, rejected = split_implicit_prompt(row["chosen"], row["rejected"])
            row = {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}
        if not chosen_kind:
            for field in _FIELDS:
                if not isinstance(row[field], str):
                    raise ValueError(f"{self._where(index, field)}: expected text, got {type(row[field]).__name__}")
            return {k: row[k] for k in _FIELDS}
        for field in _FIELDS:
            try:
                check_messages(row[field], field)
            except ValueError as err:
                raise ValueError(f"{self._where(index, field)}: {err}") from None
        try:
            return render_pair(row, self.tokenizer)
        except ValueError as err:
            raise ValueError(f"{self._where(index, 'prompt')}: {err}") from None

    def _answer(self, prompt: str, answer: str, index: int, field: str) -> dict[str, list[int]]:
        full = self.tokenizer(prompt + answer, add_special_tokens=False)
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        full_ids, full_mask = list(full["input_ids"]), list(full["attention_mask"])
        if len(full_ids) < len(prompt_ids):
            raise ValueError(f"{self._where(index, field)}: the prompt and the answer tokenize to fewer tokens than "
                             "the prompt alone")
        start = len(prompt_ids)
        if list(prompt_ids) != full_ids[:start]:  # the prompt's last token merged with the answer's first
            start -= 1
        return {"prompt_input_ids": full_ids[:start], "prompt_attention_mask": full_mask[:start],
                "input_ids": full_ids[start:], "attention_mask": full_mask[start:]}

    def __call__(self, row: Mapping[str, Any], index: int) -> dict[str, list[int]]:
        text = self._text_row(row, index)
        answers = {k: self._answer(text["prompt"], text[k], index, k) for k in ("chosen", "rejected")}
        c, r = answers["chosen"]["prompt_input_ids"], answers["rejected"]["prompt_input_ids"]
        if sum(a != b for a, b in zip(c, r)) > 1 or abs(len(c) - len(r)) > 1:
            raise ValueError(f"{self._where(index, 'prompt')}: the prompt tokenizes differently before 'chosen' "
                             "and before 'rejected' (more than the last token differs)")
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        out: dict[str, list[int]] = {}
        for key, tokens in answers.items():
            prompt_ids, prompt_mask = tokens["prompt_input_ids"], tokens["prompt_attention_mask"]
            ids, mask = tokens["input_ids"], tokens["attention_mask"]
            if bos is not None and (not prompt_ids or prompt_ids[0] != bos):
                prompt_ids, prompt_mask = [bos, *prompt_ids], [1, *prompt_mask]
            if not ids or ids[-1] != eos:
                ids, mask = [*ids, eos], [*mask, 1]
            if len(prompt_ids) >= self.max_length:
                raise ValueError(f"{self._where(index, 'prompt')}: the prompt has {len(prompt_ids)} tokens, which "
                                 f"leaves no {key!r} token within max_length={self.max_length}: shorten the prompt, "
                                 "drop the row, or raise max_length")
            keep = self.max_length - len(prompt_ids)
            ids, mask = ids[:keep], mask[:keep]
            out[f"{key}_input_ids"] = prompt_ids + ids
            out[f"{key}_attention_mask"] = prompt_mask + mask
            out[f"{key}_labels"] = [IGNORE_INDEX] * len(prompt_ids) + ids
        return out

    def batch(self, rows: Mapping[str, Sequence[Any]], indices: Sequence[int]) -> dict[str, list[Any]]:
        """``Dataset.map(batched=True, with_indices=True)``'s form."""
        out = [self({k: v[i] for k, v in rows.items()}, indices[i]) for i in range(len(indices))]
        return {k: [o[k] for o in out] for k in out[0]} if out else {}


def prepare_pair_dataset(dataset: Any, tokenizer: Any, max_length: int, trainer: str, num_proc: int | None = None,
                         name: str = "train") -> Any:
    """A ``datasets.Dataset`` of tokenized pairs from preference rows (a ``datasets.Dataset`` or a list of dicts);
    already tokenized data (a ``chosen_input_ids`` column) is returned as it is."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset) or (not hasattr(dataset, "__getitem__")
                                                         and hasattr(dataset, "__iter__")):
        raise ValueError(f"the {name} dataset is streamed: {trainer}Trainer reads a sized dataset (a "
                         "datasets.Dataset or a list of rows); take a part of the stream, e.g. "
                         "datasets.Dataset.from_list(list(ds.take(n)))")
    tokenize = PairTokenizer(tokenizer, max_length, trainer, name)
    if isinstance(dataset, datasets.Dataset):
        if "chosen_input_ids" in dataset.column_names:
            return dataset
        return dataset.map(tokenize.batch, batched=True, with_indices=True, num_proc=num_proc,
                           remove_columns=dataset.column_names, desc=f"Tokenizing the {name} dataset")
    rows = list(dataset)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{trainer} data, {name} row {i}: a row is a dict of fields, got {type(row).__name__}")
    if rows and all("chosen_input_ids" in r for r in rows):
        return datasets.Dataset.from_list(rows)
    # Rows as Python objects (mixed text and messages would not form an Arrow table): each error names its row.
    return datasets.Dataset.from_list([tokenize(row, i) for i, row in enumerate(rows)])


def _pad_rows(rows: list[list[int]], width: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


class DataCollatorForPairs:
    """Chosen and rejected sequences of a batch as one right-padded batch, the chosen rows first (the shared
    preference base's layout): ``input_ids``, ``attention_mask`` and ``completion_mask`` (1 on the answers' tokens:
    the positions TRL's labels keep).

    Padding as TRL's: each side is padded to its own longest row with ``pad_token_id``, then both to the longer
    side with ``padding_value`` (the two differ only when ORPOConfig.padding_value is set).
    """

    def __init__(self, pad_token_id: int, padding_value: int | None = None):
        self.pad_token_id = pad_token_id
        self.padding_value = pad_token_id if padding_value is None else padding_value

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        sides = {k: [list(e[f"{k}_input_ids"]) for e in examples] for k in ("chosen", "rejected")}
        width = max(len(r) for rows in sides.values() for r in rows)
        ids = []
        for rows in sides.values():
            own = _pad_rows(rows, max(len(r) for r in rows), self.pad_token_id)
            grown = torch.full((len(rows), width), self.padding_value, dtype=torch.long)
            grown[:, :own.shape[1]] = own
            ids.append(grown)
        sides_of = ("chosen", "rejected")
        attention = torch.cat([_pad_rows([list(e[f"{k}_attention_mask"]) for e in examples], width, 0)
                               for k in sides_of])
        labels = torch.cat([_pad_rows([list(e[f"{k}_labels"]) for e in examples], width, IGNORE_INDEX)
                            for k in sides_of])
        return {"input_ids": torch.cat(ids), "attention_mask": attention,
                "completion_mask": (labels != IGNORE_INDEX).long()}
