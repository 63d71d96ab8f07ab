"""Pushing a Trainer's output to the Hugging Face Hub: the seam the Trainer calls.

``Trainer.push_to_hub()`` and the saves under ``push_to_hub=True`` (``hub_strategy``) call
:func:`push_to_hub` and :func:`push_checkpoint` and nothing else. They are not built yet: until the upload
(``huggingface_hub``'s API, in the background as Hugging Face's Trainer does) lands here, both raise
:class:`HubUploadUnavailable` naming what to do instead, and a Trainer built with ``push_to_hub=True`` is
refused at construction by :func:`check_push_settings` rather than training for hours and failing at the
first save.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HubUploadUnavailable", "check_push_settings", "push_checkpoint", "push_to_hub"]

_HOW = ("uploading to the Hugging Face Hub is not available in this version of shardkit's Trainer. Train with "
        "push_to_hub=False and upload output_dir yourself (huggingface_hub.upload_folder(repo_id=..., "
        "folder_path=output_dir)); hub_model_id, hub_strategy and the other hub_* settings are kept for when it is")


class HubUploadUnavailable(NotImplementedError):
    """The Hub upload is not built in this version; the message says how to upload the output yourself."""


def check_push_settings(args: Any) -> None:
    """Called when the Trainer is built: ``push_to_hub=True`` is refused while the upload is unavailable."""
    if args.push_to_hub:
        raise HubUploadUnavailable(f"TrainingArguments.push_to_hub=True (hub_strategy={str(args.hub_strategy)!r}): "
                                   + _HOW)


def push_to_hub(trainer: Any, commit_message: str | None = "End of training", blocking: bool = True,
                token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
    """Upload ``trainer.args.output_dir`` (model, processing class, model card) to ``hub_model_id``."""
    raise HubUploadUnavailable(f"trainer.push_to_hub(): {_HOW}")


def push_checkpoint(trainer: Any, checkpoint_dir: str) -> None:
    """Upload a checkpoint as ``hub_strategy`` says (``every_save``, ``checkpoint``, ``all_checkpoints``)."""
    raise HubUploadUnavailable(f"saving {checkpoint_dir} with push_to_hub=True: {_HOW}")
