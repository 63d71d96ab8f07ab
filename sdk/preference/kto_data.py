"""KTO's data: unpaired rows (a prompt, a completion, a desirable/undesirable label) tokenized as TRL's KTOTrainer
does, and the collator that pads them and builds the mismatched pairs KTO's KL reference point is estimated on.

Accepted rows, standard (text) or conversational (message lists):

- unpaired: ``prompt``, ``completion``, ``label`` (True: desirable);
- paired: ``prompt``, ``chosen``, ``rejected`` (or ``chosen``/``rejected`` holding the whole conversation, the
  prompt being their common first messages): unpaired as TRL does, per block of 1000 rows the chosen ones
  (``label=True``) then the rejected ones.

Text completions end with the tokenizer's EOS token (added when missing); the completion's tokens are the tokens of
``prompt + completion`` after their common prefix with the prompt's. A row that cannot be trained on (a field
missing, an empty completion, a label that is not a boolean, a prompt that alone fills ``max_length``) raises a
ValueError naming the row and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from shardkit.sft.chat import CHAT_TEMPLATES, bounded_render, check_messages
from shardkit.sft.dataset import common_prefix

__all__ = ["DataCollatorForUnpairedPreference", "UnpairedTokenizer", "prepare_unpaired_dataset",
           "rotate_completions", "split_implicit_prompt", "unpair_rows"]

# TRL unpairs with one Dataset.map batch at a time (datasets' default batch size): the row order is its order.
_UNPAIR_BLOCK = 1000
_BUILT_IN = frozenset(CHAT_TEMPLATES.values())


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and "role" in value[0]


def _where(name: str, index: int, field: str) -> str:
    return f"KTO data, {name} row {index}, field {field!r}"


def split_implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` from ``chosen``/``rejected`` that each hold the whole conversation (or text):
    the prompt is their common start, as TRL's ``extract_prompt`` takes it (a space before the first difference
    stays with the completions; when one is a prefix of the other, the last common item does too)."""
    n = min(len(chosen), len(rejected))
    if n == 0:
        raise ValueError("'chosen' or 'rejected' is empty")
    idx = n - 1
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if chosen[i - 1] == " " else i
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def unpair_rows(rows: Sequence[Mapping[str, Any]], name: str = "train") -> list[dict[str, Any]]:
    """Paired rows (``chosen``/``rejected``) as unpaired ones, in TRL's order; unpaired rows returned as they are.

    Raises:
        ValueError: a row with neither ``completion`` nor ``chosen``/``rejected``, or missing one of them.
    """
    return [row for _, row in _unpair_with_sources(rows, name)]


def _unpair_with_sources(rows: Sequence[Mapping[str, Any]], name: str) -> list[tuple[int, dict[str, Any]]]:
    """:func:`unpair_rows`, each row with the index of the row it came from (for error messages)."""
    out: list[tuple[int, dict[str, Any]]] = []
    for start in range(0, len(rows), _UNPAIR_BLOCK):
        block = list(enumerate(rows[start:start + _UNPAIR_BLOCK], start))
        for index, row in block:
            if not isinstance(row, Mapping):
                raise ValueError(f"KTO data, {name} row {index}: a row is a dict of fields, got {type(row).__name__}")
        out.extend((i, dict(r)) for i, r in block if "completion" in r)
        chosen, rejected = [], []
        for index, row in ((i, r) for i, r in block if "completion" not in r):
            for field in ("chosen", "rejected"):
                if field not in row or row[field] is None:
                    raise ValueError(f"{_where(name, index, field)}: the row has no {field!r}. KTO rows are "
                                     "prompt/completion/label (unpaired) or prompt/chosen/rejected (paired)")
            extra = {k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected")}
            if "prompt" in row and (_is_messages(row["prompt"]) == _is_messages(row["chosen"])):
                prompt, good, bad = row["prompt"], row["chosen"], row["rejected"]
            elif _is_messages(row["chosen"]) == _is_messages(row["rejected"]):
                try:
                    prompt, good, bad = split_implicit_prompt(row["chosen"], row["rejected"])
                except ValueError as err:
                    raise ValueError(f"{_where(name, index, 'chosen')}: {err}") from None
            else:
                raise ValueError(f"{_where(name, index, 'rejected')}: 'chosen' and 'rejected' must both be text or "
                                 "both message lists")
            chosen.append((index, {**extra, "prompt": prompt, "completion": good, "label": True}))
            rejected.append((index, {**extra, "prompt": prompt, "completion": bad, "label": False}))
        out.extend(chosen + rejected)
    return out


class UnpairedTokenizer:
    """Tokenizes one unpaired row into ``{"prompt_ids", "completion_ids", "label"}`` as TRL's KTOTrainer does
    (picklable, for ``Dataset.map(num_proc=...)``).

    Args:
        tokenizer: a Hugging Face tokenizer (with a chat template for conversational rows).
        max_length: a prompt must leave room for at least one completion token (None: no limit).
        name: "train"/"eval", for messages.
    """

    def __init__(self, tokenizer: Any, max_length: int | None = None, name: str = "train"):
        self.tokenizer, self.max_length, self.name = tokenizer, max_length, name

    def __call__(self, row: Mapping[str, Any], index: int) -> dict[str, Any]:
        for field in ("prompt", "completion", "label"):
            if field not in row or row[field] is None:
                raise ValueError(f"{_where(self.name, index, field)}: the row has no {field!r} (unpaired KTO rows "
                                 "need 'prompt', 'completion' and 'label')")
        label = row["label"]
        if not isinstance(label, bool):
            raise ValueError(f"{_where(self.name, index, 'label')}: {label!r} is not True/False (True: the "
                             "completion is desirable)")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(completion, str) != isinstance(prompt, str):
            raise ValueError(f"{_where(self.name, index, 'completion')}: 'prompt' and 'completion' must both be text "
                             "or both message lists")
        if not completion:
            raise ValueError(f"{_where(self.name, index, 'completion')}: the completion is empty; drop the row or "
                             "give it the completion's text")
        if isinstance(prompt, str):
            prompt_ids, full_ids = self._text(prompt, completion)
        else:
            prompt_ids, full_ids = self._chat(row, index)
        n = common_prefix(prompt_ids, full_ids)
        prompt_ids, completion_ids = prompt_ids[:n], full_ids[n:]
        if not completion_ids:
            raise ValueError(f"{_where(self.name, index, 'completion')}: the completion has no tokens of its own")
        if self.max_length is not None and len(prompt_ids) >= self.max_length:
            raise ValueError(f"{_where(self.name, index, 'prompt')}: the prompt has {len(prompt_ids)} tokens, "
                             f"which leaves no completion token within max_length={self.max_length}: shorten the "
                             "prompt, drop the row, or raise max_length")
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "label": label}

    def batch(self, rows: Mapping[str, Sequence[Any]], indices: Sequence[int]) -> dict[str, list[Any]]:
        """``Dataset.map(batched=True, with_indices=True)``'s form."""
        size = len(indices)
        out = [self({k: v[i] for k, v in rows.items()}, indices[i]) for i in range(size)]
        return {k: [o[k] for o in out] for k in ("prompt_ids", "completion_ids", "label")}

    def _text(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        eos = self.tokenizer.eos_token
        if eos is not None and not completion.endswith(eos):
            completion = completion + eos
        prompt_ids = list(self.tokenizer(text=prompt)["input_ids"])
        return prompt_ids, list(self.tokenizer(text=prompt + completion)["input_ids"])

    def _chat(self, row: Mapping[str, Any], index: int) -> tuple[list[int], list[int]]:
        for field in ("prompt", "completion"):
            try:
                check_messages(row[field], field)
            except ValueError as err:
                raise ValueError(f"{_where(self.name, index, field)}: {err}") from None
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"{_where(self.name, index, 'prompt')}: conversational rows need a chat template: set "
                             "tokenizer.chat_template")
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        kwargs = {"tools": tools, **(row.get("chat_template_kwargs") or {})}
        guard = nullcontext() if template in _BUILT_IN else bounded_render()
        with guard:
            prompt_ids = self.tokenizer.apply_chat_template(row["prompt"], tokenize=True, return_dict=True,
                                                            add_generation_prompt=True, **kwargs)["input_ids"]
            full_ids = self.tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True,
                                                          return_dict=True, **kwargs)["input_ids"]
        return list(prompt_ids), list(full_ids)


def prepare_unpaired_dataset(dataset: Any, tokenizer: Any, max_length: int | None, num_proc: int | None = None,
                             name: str = "train") -> Any:
    """A ``datasets.Dataset`` of ``prompt_ids``/``completion_ids``/``label`` from KTO rows (a ``datasets.Dataset``
    or a list of dicts); already tokenized data (a ``prompt_ids`` column) is returned as it is."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset) or (not hasattr(dataset, "__getitem__")
                                                         and hasattr(dataset, "__iter__")):
        raise ValueError(f"the {name} dataset is streamed: KTOTrainer reads a sized dataset (a datasets.Dataset "
                         "or a list of rows); take a part of the stream, e.g. "
                         "datasets.Dataset.from_list(list(ds.take(n)))")
    tokenize = UnpairedTokenizer(tokenizer, max_length, name)
    if isinstance(dataset, datasets.Dataset):
        if "prompt_ids" in dataset.column_names:
            return dataset
        if "completion" in dataset.column_names:
            return dataset.map(tokenize.batch, batched=True, with_indices=True, num_proc=num_proc,
                               remove_columns=dataset.column_names, desc=f"Tokenizing the {name} dataset")
        rows: list[Any] = dataset.to_list()
    else:
        rows = list(dataset)
    if rows and all(isinstance(r, Mapping) and "prompt_ids" in r for r in rows):
        return datasets.Dataset.from_list(rows)
    # Rows as Python objects (mixed text and messages would not form an Arrow table): each error names the row
    # the user gave.
    return datasets.Dataset.from_list([tokenize(row, index) for index, row in _unpair_with_sources(rows, name)])


def rotate_completions(completions: list[list[int]]) -> list[list[int]]:
    """Each row's mismatched completion for the KL estimate: the previous row's (the first takes the last's), so
    the mismatched completions are the batch's own completions paired with other prompts."""
    return completions[-1:] + completions[:-1]


def _pad(rows: list[list[int]], value: int, multiple: int | None) -> torch.Tensor:
    width = max(len(r) for r in rows)
    if multiple:
        width = -(-width // multiple) * multiple
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


class DataCollatorForUnpairedPreference:
    """Pads tokenized unpaired rows (right padding) into ``input_ids``, ``attention_mask``, ``completion_mask`` and
    ``label``; with ``kl=True`` also ``KL_input_ids``, ``KL_attention_mask``, ``KL_completion_mask`` for the
    mismatched pairs (:func:`rotate_completions`) of this batch. Sequences are cut to ``max_length`` first."""

    def __init__(self, pad_token_id: int, max_length: int | None = None, pad_to_multiple_of: int | None = None,
                 kl: bool = True):
        self.pad_token_id, self.max_length = pad_token_id, max_length
        self.pad_to_multiple_of, self.kl = pad_to_multiple_of, kl

    def _sequences(self, prefix: str, prompts: list[list[int]], answers: list[list[int]]) -> dict[str, torch.Tensor]:
        ids, masks = [], []
        for prompt, answer in zip(prompts, answers):
            row, mask = list(prompt) + list(answer), [0] * len(prompt) + [1] * len(answer)
            if self.max_length is not None:
                row, mask = row[:self.max_length], mask[:self.max_length]
            ids.append(row)
            masks.append(mask)
        multiple = self.pad_to_multiple_of
        return {f"{prefix}input_ids": _pad(ids, self.pad_token_id, multiple),
                f"{prefix}attention_mask": _pad([[1] * len(r) for r in ids], 0, multiple),
                f"{prefix}completion_mask": _pad(masks, 0, multiple)}

    def __call__(self, examples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        prompts = [list(e["prompt_ids"]) for e in examples]
        completions = [list(e["completion_ids"]) for e in examples]
        out = self._sequences("", prompts, completions)
        if self.kl:
            out.update(self._sequences("KL_", prompts, rotate_completions(completions)))
        out["label"] = torch.tensor([bool(e["label"]) for e in examples])
        return out
