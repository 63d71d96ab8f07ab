"""SFTConfig: TrainingArguments plus TRL's supervised fine-tuning settings, under TRL's names."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from shardkit.trainer.arguments import TrainingArguments, optional_flag
from shardkit.utils.suggest import did_you_mean

__all__ = ["DATASET_KWARGS", "PACKING_STRATEGIES", "SFTConfig"]

logger = logging.getLogger("shardkit.sft")

PACKING_STRATEGIES = ("bfd", "wrapped")
# dataset_kwargs keys: the seed's two (TRL's ConstantLengthDataset names) and TRL's skip switch.
DATASET_KWARGS = ("add_special_tokens", "append_concat_token", "skip_prepare_dataset")


@dataclass
class SFTConfig(TrainingArguments):
    """Settings of an :class:`~shardkit.sft.SFTTrainer` run: every TrainingArguments field plus TRL's SFT ones.

    Data:
        dataset_text_field: the column holding plain text (language modelling data), default ``"text"``.
        max_length: tokens kept per sequence (longer ones are truncated; with packing, the length of a bin).
            None keeps whole sequences (not with packing).
        max_seq_length: the older TRL name of ``max_length`` (used when given, with a deprecation warning).
        dataset_kwargs: ``{"add_special_tokens": bool, "append_concat_token": bool, "skip_prepare_dataset": bool}``:
            let the tokenizer add its special tokens (BOS...), append the EOS token to each sample, or take the
            dataset as already tokenized (``input_ids`` and optional ``labels``/``completion_mask``).
        dataset_num_proc: processes for ``datasets.Dataset.map`` (tokenizing and packing; cached on disk).
        eos_token, pad_token: token strings replacing the tokenizer's EOS/padding tokens.
        chat_template_path: a built-in chat template name (``"chatml"``, ``"zephyr"``), a Jinja file, or a
            tokenizer directory whose template is used.
        packing_buffer_size: examples packed together: one ``Dataset.map`` batch, or one chunk of a streamed
            (iterable) dataset, which is also how much a resumed stream reads again at most.

    Packing and batches:
        packing: pack several sequences into each ``max_length`` row.
        packing_strategy: ``"bfd"`` (best-fit decreasing: whole sequences into bins, attention never crosses a
            sequence) or ``"wrapped"`` (concatenate everything and cut every ``max_length`` tokens, as TRL's old
            packing: sequences are split and attend to their neighbours).
        padding_free: concatenate a micro-batch into one row with ``position_ids`` restarting per sequence (no
            padding at all). None: on with ``packing_strategy="bfd"``, as TRL does.
        pad_to_multiple_of: round padded rows up to a multiple of this.
        eval_packing: pack the eval set too (default: as ``packing``).

    Loss:
        completion_only_loss: for prompt/completion data, loss on the completion only (None: yes, as TRL).
        assistant_only_loss: for conversations, loss on the assistant turns only (the chat template must mark them
            with ``{% generation %}``; the built-in ones do).
    """

    learning_rate: float = 2e-5  # TRL's default for SFT
    dataset_text_field: str = "text"
    max_length: int | None = 1024
    max_seq_length: int | None = None
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool | None = optional_flag()
    pad_to_multiple_of: int | None = None
    eval_packing: bool | None = optional_flag()
    completion_only_loss: bool | None = optional_flag()
    assistant_only_loss: bool = False
    dataset_kwargs: dict[str, Any] | str | None = None  # a JSON object as text from a command line
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template_path: str | None = None
    packing_buffer_size: int = 1000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_seq_length is not None:
            logger.warning("SFTConfig.max_seq_length is TRL's old name: use max_length (set to %d)",
                           self.max_seq_length)
            self.max_length, self.max_seq_length = self.max_seq_length, None
        if self.packing_strategy not in PACKING_STRATEGIES:
            hint = did_you_mean(str(self.packing_strategy), PACKING_STRATEGIES)
            raise ValueError(f"SFTConfig.packing_strategy={self.packing_strategy!r} is not one of "
                             f"{list(PACKING_STRATEGIES)}{hint}")
        for name in ("max_length", "pad_to_multiple_of", "dataset_num_proc"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"SFTConfig.{name}={value!r} must be an integer >= 1 or None")
        if self.packing_buffer_size < 1:
            raise ValueError(f"SFTConfig.packing_buffer_size={self.packing_buffer_size} must be >= 1")
        if self.packing and self.max_length is None:
            raise ValueError("SFTConfig: packing=True needs max_length (the length of a packed row); set max_length")
        self.dataset_kwargs = _check_dataset_kwargs(self.dataset_kwargs)
        if self.padding_free is None:
            self.padding_free = self.packing and self.packing_strategy == "bfd"
        if self.padding_free and self.packing and self.packing_strategy == "wrapped":
            raise ValueError("SFTConfig: padding_free=True with packing_strategy='wrapped': wrapped rows are already "
                             "full and cross sequences; use packing_strategy='bfd' for padding-free packing")

    @property
    def add_special_tokens(self) -> bool:
        return bool(self.dataset_kwargs.get("add_special_tokens", True))

    @property
    def append_concat_token(self) -> bool:
        return bool(self.dataset_kwargs.get("append_concat_token", True))

    @classmethod
    def from_training_arguments(cls, args: TrainingArguments, **overrides: Any) -> SFTConfig:
        """An SFTConfig holding ``args``' values (a plain TrainingArguments, as the FSDP seed passes) and ``overrides``
        (the seed's ``SFTTrainer(packing=..., max_seq_length=...)`` keywords).

        Raises:
            TypeError: an override that is no SFTConfig field, with the nearest name.
        """
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(overrides) - names)
        if unknown:
            sft_names = sorted(names - {f.name for f in dataclasses.fields(TrainingArguments)})
            raise TypeError(f"SFTTrainer got unknown argument {unknown[0]!r}{did_you_mean(unknown[0], sft_names)} "
                            f"(SFT settings: {sft_names})")
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and f.name in names}
        values.update(overrides)
        return cls(**values)


def _check_dataset_kwargs(value: Any) -> dict[str, Any]:
    """``dataset_kwargs`` as a dict of known switches (a JSON object string, as from the command line, is read)."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"SFTConfig.dataset_kwargs is not valid JSON ({err}): pass a dict") from err
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"SFTConfig.dataset_kwargs must be a dict, got {type(value).__name__}")
    unknown = [k for k in value if k not in DATASET_KWARGS]
    if unknown:
        raise ValueError(f"SFTConfig.dataset_kwargs: unknown key {unknown[0]!r}"
                         f"{did_you_mean(str(unknown[0]), DATASET_KWARGS)} (known: {list(DATASET_KWARGS)})")
    wrong = {k: v for k, v in value.items() if not isinstance(v, bool)}
    if wrong:
        raise ValueError(f"SFTConfig.dataset_kwargs: {sorted(wrong)} must be True or False")
    return dict(value)
