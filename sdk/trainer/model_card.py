"""``Trainer.create_model_card()``: the draft model card (``output_dir/README.md``) Hugging Face's Trainer writes.

transformers' own :class:`~transformers.modelcard.TrainingSummary` builds it (tags, datasets, task, the
hyperparameters and the evaluation results table read from ``state.log_history``), so the card is the one an HF
user gets; it reads the Trainer's arguments through :class:`_CardArgs`, which gives the two values transformers
expects as its enums (``parallel_mode``, ``lr_scheduler_type``). ``push_to_hub()`` writes the card before uploading,
as transformers does.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

__all__ = ["write_model_card"]

_CARD = "README.md"


class _CardArgs:
    """The Trainer's TrainingArguments as transformers' model card code reads them (enums where it takes ``.value``)."""

    def __init__(self, args: Any):
        self._args = args

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)

    @property
    def parallel_mode(self) -> Any:
        from transformers.training_args import ParallelMode

        return ParallelMode(str(getattr(self._args.parallel_mode, "value", self._args.parallel_mode)))

    @property
    def lr_scheduler_type(self) -> Any:
        value = self._args.lr_scheduler_type
        return types.SimpleNamespace(value=str(getattr(value, "value", value)))


def _existing_card(card_path: Path, tags: str | list[str] | None) -> tuple[str | list[str] | None, bool]:
    """As transformers: (the tags, with those of a card already there kept beside them; whether that card is peft's)."""
    if not card_path.is_file():
        return tags, False
    from huggingface_hub import ModelCard

    data = ModelCard.load(card_path).data
    if tags is not None:
        tags = [tags] if isinstance(tags, str) else list(tags)
        tags += [t for t in data.tags or [] if t not in tags]
    return tags, data.get("library_name") == "peft"


def write_model_card(trainer: Any, language: str | None = None, license: str | None = None,
                     tags: str | list[str] | None = None, model_name: str | None = None,
                     finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                     dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                     dataset_args: str | list[str] | None = None) -> Path | None:
    """Write ``output_dir/README.md`` from the run (main process only); returns its path, None on other ranks.

    Arguments as transformers' ``Trainer.create_model_card``: what is left out is inferred from the model (its Hub
    name, task) and the dataset, and the ``generated_from_trainer`` tag is added.
    """
    if not trainer.is_world_process_zero():
        return None
    try:
        from transformers.modelcard import TrainingSummary
    except ImportError:
        raise ImportError("create_model_card() renders the card with transformers' TrainingSummary: "
                          "pip install transformers") from None
    output_dir = Path(trainer.args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / _CARD
    tags, peft_card = _existing_card(path, tags)
    model = unwrapped = trainer.runner.unwrap_model(trainer.model)
    if not hasattr(model, "config"):  # a plain torch module: no Hub name, no task to infer
        model = types.SimpleNamespace(config=types.SimpleNamespace())
    view = types.SimpleNamespace(args=_CardArgs(trainer.args), model=model, state=trainer.state,
                                 train_dataset=trainer.train_dataset, eval_dataset=trainer.eval_dataset)
    summary = TrainingSummary.from_trainer(view, language=language, license=license,
                                           tags=tags, model_name=model_name,
                                           finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                                           dataset=dataset, dataset_args=dataset_args)
    path.write_text(summary.to_model_card(), encoding="utf-8")
    if peft_card and hasattr(unwrapped, "create_or_update_model_card"):
        unwrapped.create_or_update_model_card(str(output_dir))  # peft adds its own sections back, as transformers
    return path
