"""Pushing a Trainer's output to the Hugging Face Hub: the seam the Trainer calls.

``Trainer.push_to_hub()`` and the saves under ``push_to_hub=True`` (``hub_strategy``) call
:func:`push_to_hub` and :func:`push_checkpoint` and nothing else; the uploads go through
:class:`shardkit.hub.HubPusher` (``huggingface_hub``'s API, in the background as Hugging Face's Trainer does),
from the main process only. ``trainer.push_to_hub()`` uploads ``output_dir``. Uploads at each save are not wired
into the Trainer's saves yet: a Trainer built with ``push_to_hub=True`` and a ``hub_strategy`` other than
``"end"`` is refused at construction by :func:`check_push_settings` rather than training for hours without
pushing; ``hub_strategy="end"`` with a final ``trainer.push_to_hub()`` works.
"""

from __future__ import annotations

import weakref
from typing import Any

from shardkit.hub import HubPusher

__all__ = ["HubUploadUnavailable", "check_push_settings", "push_checkpoint", "push_to_hub"]

_HOW = ("uploads at each save are not wired into shardkit's Trainer yet: use hub_strategy='end' and call "
        "trainer.push_to_hub() after training (it uploads output_dir through huggingface_hub), or upload a "
        "checkpoint yourself (huggingface_hub.upload_folder(repo_id=..., folder_path=...))")
_PUSHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trainer -> its run's HubPusher


class HubUploadUnavailable(NotImplementedError):
    """An upload that this version does not make; the message says what to do instead."""


def check_push_settings(args: Any) -> None:
    """Called when the Trainer is built: the hub settings are checked (a misspelt ``hub_strategy`` is named) and
    ``push_to_hub=True`` with per-save uploads is refused while those are not wired."""
    if not args.push_to_hub:
        return
    pusher = HubPusher.from_args(args)
    if pusher.strategy != "end":
        raise HubUploadUnavailable(f"TrainingArguments.push_to_hub=True (hub_strategy={pusher.strategy!r}): " + _HOW)


def pusher_for(trainer: Any) -> HubPusher:
    """The trainer's HubPusher (one per Trainer, so uploads still running are waited for by the next push)."""
    if trainer not in _PUSHERS:
        _PUSHERS[trainer] = HubPusher.from_args(trainer.args)
    return _PUSHERS[trainer]


def push_to_hub(trainer: Any, commit_message: str | None = "End of training", blocking: bool = True,
                token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
    """Save the model to ``output_dir`` (every rank) and upload it (not its checkpoints) from the main process.

    ``commit_message=None`` (``init_hf_repo``, ``create_model_card``) only creates the repository. Returns the
    upload's result (its future with ``blocking=False``); None on other ranks.
    """
    pusher = pusher_for(trainer)
    if token is not None:
        pusher.token = token
    if revision is not None:
        pusher.revision = revision
    if commit_message is not None:
        trainer.save_model(_internal_call=True)
    if not trainer.is_world_process_zero():
        return None
    if commit_message is None:
        pusher.create_repo()
        return None
    return pusher.push_final(trainer.args.output_dir, commit_message, blocking)


def push_checkpoint(trainer: Any, checkpoint_dir: str) -> None:
    """Upload a checkpoint as ``hub_strategy`` says (``every_save``, ``checkpoint``, ``all_checkpoints``)."""
    raise HubUploadUnavailable(f"saving {checkpoint_dir} with push_to_hub=True: {_HOW}")
