"""Turning SFT data into tokenized (and packed) examples: ``{"input_ids", "labels"[, "position_ids"]}``.

Three kinds of data, recognised per example as TRL does:

- language modelling: a text column (``dataset_text_field``), or ``formatting_func(example) -> str``: loss on
  every token;
- conversational: ``messages`` (``[{"role", "content"}, ...]``) rendered with the tokenizer's chat template;
  with ``assistant_only_loss`` the loss is on the assistant turns only (the template's ``{% generation %}``);
- prompt/completion: ``prompt`` and ``completion`` (both text, or both message lists); with
  ``completion_only_loss`` (the default) the loss is on the completion only.

Already-tokenized data (an ``input_ids`` column, with optional ``labels``, ``completion_mask`` or
``assistant_masks``) is taken as it is. A Hugging Face ``Dataset`` is processed with ``Dataset.map`` (batched,
``dataset_num_proc`` processes, cached on disk next to a dataset loaded from files); a streamed one
(``IterableDataset``, any iterable) becomes a :class:`~shardkit.data.streaming.ChunkedStream` that tokenizes and packs
``packing_buffer_size`` examples at a time while training reads it.

An example that cannot be tokenized raises a ValueError naming its index (in the dataset; a streamed one shows its
start), the field at fault and the fix; each rendering of a chat template other than shardkit's built-in ones is
bounded (:func:`~shardkit.sft.chat.bounded_render`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

from shardkit.data.streaming import ChunkedStream, is_stream
from shardkit.sft.chat import (
    CHAT_TEMPLATES,
    MAX_RENDER_CHARS,
    RENDER_SECONDS,
    ChatTemplateError,
    bounded_render,
    check_messages,
)
from shardkit.sft.packing import IGNORE_INDEX, pack_examples

__all__ = ["SFTTokenizer", "common_prefix", "prepare_dataset"]

logger = logging.getLogger("shardkit.sft")

_BUILT_IN = frozenset(CHAT_TEMPLATES.values())

try:  # transformers renders chat templates with jinja2; without it no template renders and none of these is raised
    from jinja2.exceptions import TemplateError as _TemplateError
    from jinja2.exceptions import TemplateSyntaxError as _TemplateSyntaxError
except ImportError:  # pragma: no cover
    _TemplateError = _TemplateSyntaxError = type("_NoJinja", (Exception,), {})

_KEEP = ("input_ids", "labels")


class SFTTokenizer:
    """Tokenizes one example at a time into ``{"input_ids", "labels"}`` (picklable, for ``map(num_proc=...)``).

    Args:
        tokenizer: a Hugging Face tokenizer (fast, for assistant masks).
        text_field: the text column of language-modelling data.
        max_length: keep the first ``max_length`` tokens (None: all).
        add_special_tokens: let the tokenizer add its special tokens to text (not to chat-templated text).
        append_eos: end each text example with ``eos_token_id`` (chat templates end turns themselves).
        eos_token_id: the token that ends a sample.
        completion_only_loss: prompt/completion data trains on the completion only (None: yes).
        assistant_only_loss: conversations train on the assistant turns only.
        formatting_func: ``f(example) -> str`` giving the text of an example.

    ``render_seconds`` and ``max_render_chars`` bound one chat template rendering (see
    :func:`~shardkit.sft.chat.bounded_render`).
    """

    render_seconds = RENDER_SECONDS
    max_render_chars = MAX_RENDER_CHARS

    def __init__(self, tokenizer: Any, text_field: str = "text", max_length: int | None = None,
                 add_special_tokens: bool = True, append_eos: bool = True, eos_token_id: int | None = None,
                 completion_only_loss: bool | None = None, assistant_only_loss: bool = False,
                 formatting_func: Callable[[Mapping[str, Any]], str] | None = None):
        self.tokenizer, self.text_field, self.max_length = tokenizer, text_field, max_length
        self.add_special_tokens, self.append_eos = add_special_tokens, append_eos
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.completion_only_loss = completion_only_loss is not False
        self.assistant_only_loss = assistant_only_loss
        self.formatting_func = formatting_func

    def __call__(self, example: Mapping[str, Any], index: int | None = None) -> dict[str, list[int]]:
        """Tokenize one example; ``index`` (its row in the dataset) is named in the error if it cannot be."""
        try:
            ids, labels = self._tokens(example)
        except ChatTemplateError:
            raise  # the template, not this example
        except (ValueError, TypeError, KeyError, _TemplateError) as err:
            where = f"example {index}" if index is not None else f"a streamed example ({_brief(example)})"
            what = "rendering the chat template failed: " if isinstance(err, _TemplateError) else ""
            raise ValueError(f"SFT data, {where}: {what}{err}") from err
        if self.max_length is not None:
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        return {"input_ids": ids, "labels": labels}

    def batch(self, examples: Mapping[str, Sequence[Any]], indices: Sequence[int] | None = None
              ) -> dict[str, list[list[int]]]:
        """``Dataset.map(batched=True[, with_indices=True])``'s form: columns in, columns out; empty results are
        dropped."""
        size = len(next(iter(examples.values()))) if examples else 0
        rows = [self({k: v[i] for k, v in examples.items()}, indices[i] if indices is not None else None)
                for i in range(size)]
        rows = [r for r in rows if r["input_ids"]]
        return {k: [r[k] for r in rows] for k in _KEEP}

    def _tokens(self, example: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        if self.formatting_func is not None:
            text = self.formatting_func(example)
            if not isinstance(text, str):
                raise TypeError(f"formatting_func must return a str per example, got {type(text).__name__} (TRL's "
                                "batched formatting functions returning lists are not taken: return one text)")
            return self._text(text)
        if "input_ids" in example:
            return _pretokenized(example)
        if "messages" in example:
            return self._conversation(example["messages"], example.get("tools"), "messages")
        if "prompt" in example and "completion" in example:
            return self._prompt_completion(example["prompt"], example["completion"])
        if self.text_field in example:
            text = example[self.text_field]
            if isinstance(text, list) and text and isinstance(text[0], Mapping):  # messages under the text field
                return self._conversation(text, None, self.text_field)
            return self._text(text)
        raise ValueError(f"an example has columns {sorted(example)}: SFT data needs {self.text_field!r} (set "
                         "dataset_text_field), 'messages', 'prompt' + 'completion', 'input_ids', or a formatting_func")

    def _text(self, text: Any) -> tuple[list[int], list[int]]:
        if not isinstance(text, str):
            raise TypeError(f"the {self.text_field!r} column must hold text, got {type(text).__name__}")
        ids = list(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])
        if self.append_eos and self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
            ids.append(self.eos_token_id)
        return ids, list(ids)

    def _chat(self, messages: list, **kwargs: Any) -> dict[str, list[int]]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("conversational data ('messages') needs a chat template: set tokenizer.chat_template, "
                             "or SFTConfig(chat_template_path='chatml')")
        # shardkit's own templates do work linear in the messages: they skip the guard (tracing slows the whole
        # call, tokenizer included, by a third); any other template is code from elsewhere and is bounded.
        template = self.tokenizer.chat_template
        guard = nullcontext() if template in _BUILT_IN else bounded_render(self.render_seconds, self.max_render_chars)
        try:
            with guard:
                out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
        except _TemplateSyntaxError as err:
            raise ChatTemplateError(f"the chat template does not parse (template line {err.lineno}: {err.message}): "
                                    "fix tokenizer.chat_template, or the file given as "
                                    "SFTConfig(chat_template_path=...)") from err
        return {k: list(v) for k, v in out.items()}

    def _conversation(self, messages: list, tools: Any, field: str) -> tuple[list[int], list[int]]:
        check_messages(messages, field)
        extra = {"tools": tools} if tools else {}
        out = self._chat(messages, return_assistant_tokens_mask=self.assistant_only_loss, **extra)
        ids = out["input_ids"]
        if not self.assistant_only_loss:
            return ids, list(ids)
        mask = out["assistant_masks"]
        if any(m["role"] == "assistant" for m in messages) and not any(mask):
            raise ValueError("assistant_only_loss=True but the chat template marks no assistant tokens: it needs "
                             "{% generation %} ... {% endgeneration %} around assistant content (the built-in "
                             "templates have it: SFTConfig(chat_template_path='chatml'))")
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]

    def _prompt_completion(self, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
        if isinstance(prompt, list):
            check_messages(prompt, "prompt")
            check_messages(completion, "completion")
            if self.assistant_only_loss:
                raise ValueError("assistant_only_loss is for 'messages' data; prompt/completion data takes "
                                 "completion_only_loss")
            prompt_ids = self._chat(prompt, add_generation_prompt=True)["input_ids"]
            ids = self._chat(prompt + completion)["input_ids"]
        else:
            prompt_ids = list(self.tokenizer(prompt, add_special_tokens=self.add_special_tokens)["input_ids"])
            ids = list(self.tokenizer(prompt + completion, add_special_tokens=self.add_special_tokens)["input_ids"])
            if self.append_eos and self.eos_token_id is not None and (not ids or ids[-1] != self.eos_token_id):
                ids.append(self.eos_token_id)
        shared = common_prefix(prompt_ids, ids)
        if shared != len(prompt_ids):
            logger.warning("a prompt tokenizes differently alone and followed by its completion; the completion is "
                           "taken from token %d (the common prefix)", shared)
        if not self.completion_only_loss:
            return ids, list(ids)
        return ids, [IGNORE_INDEX] * shared + ids[shared:]


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items ``a`` and ``b`` share: where a rendered prompt's tokens stop matching the rendered
    conversation's (a chat template may render the prompt alone differently at its end)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _pretokenized(example: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    ids = list(example["input_ids"])
    if example.get("labels") is not None:
        return ids, list(example["labels"])
    labels = list(ids)
    for key in ("completion_mask", "assistant_masks"):
        if example.get(key) is not None:
            labels = [t if m else IGNORE_INDEX for t, m in zip(labels, example[key])]
    return ids, labels


class _PackBatch:
    """``Dataset.map(batched=True)`` packing: a batch of tokenized examples in, packed rows out."""

    def __init__(self, max_length: int, strategy: str):
        self.max_length, self.strategy = max_length, strategy

    def __call__(self, batch: Mapping[str, Sequence[Any]]) -> dict[str, list]:
        examples = [{"input_ids": i, "labels": lab} for i, lab in zip(batch["input_ids"], batch["labels"])]
        rows = pack_examples(examples, self.max_length, self.strategy)
        return {k: [r[k] for r in rows] for k in ("input_ids", "labels", "position_ids")}


class _StreamTransform:
    """A chunk of raw streamed examples -> tokenized (and packed) items."""

    def __init__(self, tokenize: SFTTokenizer, pack: tuple[int, str] | None):
        self.tokenize, self.pack = tokenize, pack

    def __call__(self, chunk: list[Mapping[str, Any]]) -> list[dict[str, list[int]]]:
        rows = [r for r in (self.tokenize(e) for e in chunk) if r["input_ids"]]
        return pack_examples(rows, *self.pack) if self.pack is not None else rows


def prepare_dataset(dataset: Any, tokenize: SFTTokenizer, packing: bool, max_length: int | None,
                    strategy: str = "bfd", num_proc: int | None = None, buffer_size: int = 1000,
                    name: str = "train") -> Any:
    """Tokenize (and pack) ``dataset`` for SFT; see the module docstring.

    Args:
        dataset: a ``datasets.Dataset``/``IterableDataset``, a list of dicts, a map-style torch Dataset of dicts,
            or any iterable of dicts (streamed).
        tokenize: the per-example tokenizer.
        packing: pack into rows of ``max_length`` with ``strategy`` ("bfd" or "wrapped").
        num_proc: ``Dataset.map`` processes.
        buffer_size: examples packed together (a map batch, or a chunk of a stream).
        name: "train"/"eval", for messages.
    """
    pack = (max_length, strategy) if packing else None
    if isinstance(dataset, ChunkedStream):
        return dataset  # already prepared
    if is_stream(dataset) or (not hasattr(dataset, "__getitem__") and hasattr(dataset, "__iter__")):
        return ChunkedStream(dataset, _StreamTransform(tokenize, pack), chunk_size=buffer_size)
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        dataset = _to_hf(dataset, name)
    tokenized = dataset.map(tokenize.batch, batched=True, with_indices=True, num_proc=num_proc,
                            remove_columns=dataset.column_names, desc=f"Tokenizing the {name} dataset")
    if pack is None:
        return tokenized
    return tokenized.map(_PackBatch(*pack), batched=True, batch_size=buffer_size, num_proc=num_proc,
                         remove_columns=tokenized.column_names, desc=f"Packing the {name} dataset ({strategy})")


def _to_hf(dataset: Any, name: str) -> Any:
    import datasets
    import pyarrow

    if isinstance(dataset, list):
        rows = dataset
    else:
        try:
            rows = [dict(dataset[i]) for i in range(len(dataset))]
        except (TypeError, KeyError) as err:
            raise TypeError(f"the {name} dataset ({type(dataset).__name__}) is neither a datasets.Dataset, a list of "
                            "dicts, a map-style dataset of dicts nor an iterable: pass one of those") from err
    for i, row in enumerate(rows):  # before Arrow, whose errors name neither the row nor the field
        if not isinstance(row, Mapping):
            raise TypeError(f"SFT data, {name} example {i}: an example is a dict of fields, got {type(row).__name__}")
        for field in ("messages", "prompt", "completion"):
            if isinstance(row.get(field), (list, tuple)):
                try:
                    check_messages(row[field], field)
                except ValueError as err:
                    raise ValueError(f"SFT data, {name} example {i}: {err}") from None
    try:
        return datasets.Dataset.from_list(rows)
    except pyarrow.ArrowException as err:
        raise ValueError(f"SFT data, the {name} dataset does not form a table: {_first_mismatch(rows)} "
                         f"(Arrow: {err})") from err


def _brief(example: Any) -> str:
    text = repr(example)
    return text if len(text) <= 80 else text[:77] + "..."


def _kinds(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, kind) of each leaf; list items share one path, as an Arrow column types them all alike."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _kinds(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        yield path, "list"
        for item in value:
            yield from _kinds(item, f"{path}[]")
    elif value is not None:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        yield path, "number" if number else type(value).__name__


def _first_mismatch(rows: Sequence[Mapping[str, Any]]) -> str:
    """The first example whose field holds another kind of value than the same field of an earlier example."""
    seen: dict[str, tuple[str, int]] = {}
    for i, row in enumerate(rows):
        for path, kind in _kinds(row, ""):
            first = seen.setdefault(path, (kind, i))
            if first[0] != kind:
                return (f"example {i} field {path!r} holds {kind} where example {first[1]} holds {first[0]}; a field "
                        "holds one kind of value in every example: convert it (e.g. str(...)) before training")
    return "its fields hold different kinds of value across examples; make each field one kind"
