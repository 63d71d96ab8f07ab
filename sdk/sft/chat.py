"""Chat templates (ChatML and Zephyr built in, with assistant-turn marks) and a tokenizer trained locally.

    tokenizer = train_tokenizer(["examples/data/public_domain.txt"], vocab_size=512, chat_template="chatml")
    ids = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)

The built-in templates render as the FSDP seed's (``<|im_start|>role\\ncontent<|im_end|>\\n`` for ChatML) and
wrap each assistant turn's content and end token in ``{% generation %}``, which is how Hugging Face's
``apply_chat_template`` knows the tokens an assistant-only loss trains on.

A template is code from wherever the tokenizer came from: jinja2's sandbox keeps it from Python's internals, and
:func:`bounded_render` bounds each rendering in time and in output (see there for what it cannot bound).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardkit.utils.suggest import did_you_mean

__all__ = ["CHAT_TEMPLATES", "MAX_RENDER_CHARS", "RENDER_SECONDS", "SPECIAL_TOKENS", "ChatTemplateError",
           "RenderLimitError", "bounded_render", "check_messages", "set_chat_template", "text_conversations",
           "train_tokenizer"]

# One conversation's rendering: far above any real chat (128k tokens are ~0.5M characters), far below a hang.
RENDER_SECONDS = 10.0
MAX_RENDER_CHARS = 1 << 26
_TEMPLATE_FILE = "<template>"  # the file name jinja2 gives the code it compiles from a string (from_string)


class ChatTemplateError(ValueError):
    """The chat template itself is wrong (it does not parse): no example renders with it."""


class RenderLimitError(ValueError):
    """A rendering ran past :data:`RENDER_SECONDS` or produced more than :data:`MAX_RENDER_CHARS` characters."""


@contextmanager
def bounded_render(seconds: float = RENDER_SECONDS, max_chars: int = MAX_RENDER_CHARS) -> Iterator[None]:
    """Bound the jinja2 template code run inside the block: raise :class:`RenderLimitError` once it has run
    ``seconds`` or yielded more than ``max_chars`` characters.

    Works in any thread and process (a trace function on the current thread, not a signal): every step of the
    template's own code (each loop iteration, macro call, recursion, output) is checked, so loops nested to any
    depth and output built piece by piece are stopped. What it cannot stop is one operation the template hands to
    Python that is large by itself (``'x' * 10**9`` allocates before the next step is seen): that is bounded only by
    Python's MemoryError, as in any in-process sandbox; the check catches it right after. The trace function that
    was set before (a debugger, coverage) is restored on exit; template lines run meanwhile go unrecorded by it.
    Tracing slows all Python code inside the block (about a third of a conversation's tokenization, measured).
    """
    deadline = time.monotonic() + seconds
    produced = 0

    def step(frame: Any, event: str, arg: Any) -> Any:
        nonlocal produced
        if event == "return" and isinstance(arg, str):  # a generator's yield, a macro's result
            produced += len(arg)
            if produced > max_chars:
                raise RenderLimitError(f"the chat template produced more than {max_chars} characters for one "
                                       "conversation: it loops or repeats without end; check the template")
        if time.monotonic() > deadline:
            raise RenderLimitError(f"the chat template ran over {seconds:g} s for one conversation: it loops "
                                   "without end or nearly; check the template")
        return step

    def enter(frame: Any, event: str, arg: Any) -> Any:
        return step if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        yield
    finally:
        sys.settrace(previous)


def check_messages(messages: Any, field: str = "messages") -> None:
    """A conversation as chat templates read it: a list of ``{"role": str, "content": str}`` (``content`` may be a
    list of content blocks, or empty beside ``tool_calls``).

    Raises:
        ValueError: naming the message and the field that is wrong, and the fix.
    """
    shape = "a list of {'role': ..., 'content': ...} dicts"
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, (list, tuple)):
        raise ValueError(f"{field!r} must be {shape}, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be a dict with 'role' and 'content' ({shape}), got "
                             f"{type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            got = "has no 'role'" if role is None else f"has role {role!r:.40}, not a name"
            raise ValueError(f"{where} {got}: give every message a 'role' string ('system', 'user', 'assistant', "
                             "'tool')")
        content = message.get("content")
        if content is None and message.get("tool_calls") is None:
            raise ValueError(f"{where} ({role}) has no 'content': give it the message's text (an empty string if "
                             "there is none)")
        if not (content is None or isinstance(content, str) or
                (isinstance(content, (list, tuple)) and all(isinstance(b, Mapping) for b in content))):
            raise ValueError(f"{where}['content'] is {type(content).__name__} ({content!r:.40}): content must be "
                             "text (a str) or a list of content blocks ({'type': 'text', 'text': ...}); convert "
                             "it with str() before training")

_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_ZEPHYR = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + eos_token }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + eos_token + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

CHAT_TEMPLATES = {"chatml": _CHATML, "zephyr": _ZEPHYR}
# The seed's special tokens per template: eos ends an assistant turn, so generation stops there.
SPECIAL_TOKENS = {
    "chatml": {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>",
               "additional_special_tokens": ["<|im_start|>"]},
    "zephyr": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
               "additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>"]},
}


def set_chat_template(tokenizer: Any, template: str) -> Any:
    """Give ``tokenizer`` a chat template: a built-in name, a Jinja file, or a tokenizer directory's template.

    A built-in name also adds its special tokens the tokenizer lacks (``<|im_start|>``, ``<|im_end|>`` ...): resize
    the model's embeddings to ``len(tokenizer)`` afterwards (the seed does, with ``resize_token_embeddings``).

    Raises:
        ValueError: ``template`` is neither a built-in name nor an existing file or directory.
    """
    if template in CHAT_TEMPLATES:
        special = SPECIAL_TOKENS[template]
        missing = [t for t in special["additional_special_tokens"] + [special["eos_token"]]
                   if t not in tokenizer.get_vocab()]
        if missing:
            tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
        tokenizer.chat_template = CHAT_TEMPLATES[template]
        return tokenizer
    path = Path(template)
    if path.is_file():
        if path.stat().st_size > 1 << 20:
            raise ValueError(f"chat template file {path} is {path.stat().st_size} bytes; a template is text under "
                             "1 MiB")
        tokenizer.chat_template = path.read_text(encoding="utf-8")
        return tokenizer
    if path.is_dir():
        from transformers import AutoTokenizer

        source = AutoTokenizer.from_pretrained(str(path))
        if not source.chat_template:
            raise ValueError(f"the tokenizer in {path} has no chat template")
        tokenizer.chat_template = source.chat_template
        return tokenizer
    raise ValueError(f"chat template {template!r} is not a built-in ({sorted(CHAT_TEMPLATES)})"
                     f"{did_you_mean(template, CHAT_TEMPLATES)} nor an existing Jinja file or tokenizer directory")


def train_tokenizer(files: Iterable[str | Path] = (), vocab_size: int = 512, chat_template: str | None = "chatml",
                    texts: Iterable[str] = ()) -> Any:
    """A byte-level BPE tokenizer trained here on ``files`` and ``texts`` (nothing downloaded), as a
    ``transformers.PreTrainedTokenizerFast`` with the chat template's special tokens and template.

    Byte-level: every string encodes (unknown characters fall back to bytes), and decoding gives the text back.

    Args:
        files: text files to learn merges from (e.g. ``examples/data/public_domain.txt``).
        vocab_size: the vocabulary size (256 bytes + merges + special tokens).
        chat_template: a built-in template name (its special tokens are added), or None for plain text.
        texts: more training text, given directly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL_TOKENS.get(chat_template or "chatml", SPECIAL_TOKENS["chatml"])
    tokens = [special["pad_token"], special["bos_token"], special["eos_token"], *special["additional_special_tokens"]]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [Path(f).read_text(encoding="utf-8") for f in files] + list(texts)
    if not corpus:
        raise ValueError("train_tokenizer needs training text: pass files=[...] or texts=[...]")
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=special["bos_token"],
                                        eos_token=special["eos_token"], pad_token=special["pad_token"],
                                        additional_special_tokens=special["additional_special_tokens"])
    if chat_template is not None:
        set_chat_template(tokenizer, chat_template)
    return tokenizer


def text_conversations(text: str, max_turns: int = 3, system: str | None = "Continue the text.",
                       split: str = r"(?<=[.!?])\s+") -> list[dict[str, Any]]:
    """A small chat set made from plain text, for examples and tests (no downloads): conversation ``k`` starts at
    sentence ``k`` and asks, turn after turn, for the sentence after the one given (1 to ``max_turns`` turns), so
    lengths vary from a few tokens to a few hundred. ``split`` is the regex between sentences (a pattern that also
    cuts at commas gives many short pieces).

    Returns:
        ``[{"messages": [{"role": ..., "content": ...}, ...]}, ...]``.
    """
    import re

    sentences = [s.strip() for s in re.split(split, " ".join(text.split())) if s.strip()]
    conversations = []
    for start in range(len(sentences) - 1):
        turns = start % max_turns + 1
        messages = [{"role": "system", "content": system}] if system else []
        for i in range(start, min(start + 2 * turns, len(sentences) - 1), 2):
            messages += [{"role": "user", "content": sentences[i]},
                         {"role": "assistant", "content": sentences[i + 1]}]
        conversations.append({"messages": messages})
    return conversations
