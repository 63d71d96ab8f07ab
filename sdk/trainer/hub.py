"""Pushing a Trainer's output to the Hugging Face Hub: the seam the Trainer calls.

``Trainer.push_to_hub()`` and the saves under ``push_to_hub=True`` (``hub_strategy``) call
:func:`push_to_hub` and :func:`push_checkpoint` and nothing else; the uploads go through
:class:`~shardkit.trainer.hub_pusher.HubPusher`
(``huggingface_hub``'s API, in the background as Hugging Face's Trainer does),
from the main process only. ``trainer.push_to_hub()`` uploads ``output_dir``; under ``push_to_hub=True`` each
checkpoint save, once the checkpoint is complete on every rank, calls :func:`push_checkpoint` (the model files,
and under ``hub_strategy="checkpoint"``/``"all_checkpoints"`` the whole checkpoint folder, resumable), and the end
of ``train()`` waits for those uploads (:func:`finish_pushes`).
"""

from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from shardkit.trainer.hub_pusher import HubPusher

_log = logging.getLogger("shardkit.trainer")

__all__ = ["check_push_settings", "finish_pushes", "push_checkpoint", "push_to_hub"]

_PUSHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trainer -> its run's HubPusher


def check_push_settings(args: Any) -> None:
    """Called when the Trainer is built: the hub settings are checked (a misspelt ``hub_strategy``, an empty
    ``hub_model_id`` is named) before training, not at the first save."""
    if args.push_to_hub:
        HubPusher.from_args(args)


def pusher_for(trainer: Any) -> HubPusher:
    """The trainer's HubPusher (one per Trainer, so uploads still running are waited for by the next push)."""
    if trainer not in _PUSHERS:
        _PUSHERS[trainer] = HubPusher.from_args(trainer.args)
    return _PUSHERS[trainer]


def push_to_hub(trainer: Any, commit_message: str | None = "End of training", blocking: bool = True,
                token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
    """Save the model to ``output_dir`` (every rank) and upload it (not its checkpoints) from the main process.

    ``commit_message=None`` (``init_hf_repo``) only creates the repository. ``allow_patterns`` /
    ``ignore_patterns`` choose what of ``output_dir`` goes up, as in ``huggingface_hub.upload_folder`` (hidden
    files and links leaving ``output_dir`` never do; the list sent is logged). Other keywords go to
    ``create_model_card`` (the card is written into ``output_dir`` and uploaded with the model, as transformers).
    Returns the upload's result (its future with ``blocking=False``); None on other ranks.
    """
    pusher = pusher_for(trainer)
    if token is not None:
        pusher.token = token
    if revision is not None:
        pusher.revision = revision
    patterns = {name: kwargs.pop(name, None) for name in ("allow_patterns", "ignore_patterns")}
    private = kwargs.pop("private", None)  # transformers' push_to_hub(private=...): the repository's visibility
    if private is not None:
        pusher.private = private
    if commit_message is not None:
        trainer.save_model(_internal_call=True)
    if not trainer.is_world_process_zero():
        return None
    if commit_message is None:
        pusher.create_repo()
        return None
    # As transformers: the draft model card goes up with the model (kwargs are create_model_card's). The card is
    # rendered by transformers; a plain torch model pushed with only the hub extra goes up without one.
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        trainer.create_model_card(model_name=kwargs.pop("model_name", None) or pusher.repo_id.split("/")[-1],
                                  **kwargs)
    else:
        _log.info("push_to_hub: no model card (rendering it needs transformers: pip install transformers)")
    return pusher.push_final(trainer.args.output_dir, commit_message, blocking, **patterns)


def push_checkpoint(trainer: Any, checkpoint_dir: str | Path) -> list[Future]:
    """After a complete checkpoint save under ``push_to_hub=True``: upload as ``hub_strategy`` says, in the
    background, from the main process (``on_push_begin`` first, as transformers). Returns the uploads started."""
    if not trainer.args.push_to_hub or not trainer.is_world_process_zero():
        return []
    pusher = pusher_for(trainer)
    if pusher.would_push():
        trainer.control = trainer.callback_handler.on_push_begin(trainer.args, trainer.state, trainer.control)
    state, strategy = trainer.state, str(getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy))
    message = (f"Training in progress, step {state.global_step}" if strategy == "steps" else
               f"Training in progress, epoch {int(state.epoch or 0)}")  # transformers' words
    return pusher.push_save(trainer.args.output_dir, checkpoint_dir, message)


def wait_for_folder(trainer: Any, folder: str | Path) -> None:
    """Before a rotation deletes ``folder``: wait for a Hub upload still reading it (none without push_to_hub)."""
    pusher = _PUSHERS.get(trainer)
    if pusher is not None:
        pusher.wait_for_folder(folder)


def finish_pushes(trainer: Any) -> None:
    """At the end of ``train()``: wait for the checkpoint uploads still running (one that failed raises here)."""
    pusher = _PUSHERS.get(trainer)
    if pusher is not None:
        pusher.wait()
