"""Uploading a training run to the Hugging Face Hub through ``huggingface_hub``'s API, as transformers' Trainer does.

    pusher = HubPusher.from_args(args)            # TrainingArguments: hub_model_id, hub_strategy, hub_token, ...
    pusher.push_save(output_dir, "checkpoint-500")  # after each save: in the background, per hub_strategy
    pusher.push_final(output_dir)                 # trainer.push_to_hub(): waits for the uploads still running

The Trainer calls these and nothing else (its ``push_to_hub`` and its saves under ``push_to_hub=True``); only the
main process uploads. ``hub_strategy`` decides what a save uploads, as in transformers:

- ``"every_save"``: the model files in ``output_dir`` (weights, config, tokenizer; a checkpoint's are first copied
  there, as transformers does), never the ``checkpoint-*`` folders; a save while the previous upload still runs is
  skipped unless ``hub_always_push``;
- ``"checkpoint"``: that, plus the latest checkpoint folder, whole, as ``last-checkpoint/``: the model, optimizer,
  scheduler, RNG and data-position state, trainer_state.json, as transformers pushes it, so that a run downloaded
  from the Hub resumes with ``resume_from_checkpoint=".../last-checkpoint"`` exactly where it stopped;
- ``"all_checkpoints"``: that, plus every checkpoint folder, whole, under its own name;
- ``"end"``: nothing until ``push_final``.

Every upload sends an explicit list of files, logged: never a hidden file or folder (``.env``, ``.ssh/``, ``.git``),
never a link whose target lies outside the folder pushed (its content would leave the machine), never a link to a
folder; each one left out is named in a warning. ``push_final`` also takes ``allow_patterns`` / ``ignore_patterns``
(``huggingface_hub.upload_folder``'s, matched against paths relative to the folder).
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import glob
import logging
import os
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from shardkit.utils.suggest import did_you_mean

__all__ = ["CHECKPOINT_FILES", "HUB_STRATEGIES", "MODEL_FILES", "HubPusher", "files_to_upload"]

log = logging.getLogger("shardkit.trainer.hub_pusher")

HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
# What a push of output_dir leaves out: the checkpoints (pushed on their own per strategy) and private files.
_OUTPUT_IGNORE = ["_*", "checkpoint-*"]
# The files from_pretrained / AutoTokenizer read (transformers' and peft's names). An allow-list, so shardkit's own
# entries (model.rank*.safetensors, optimizer.*, rng.*, loader.*, values.*, shardkit.json...) never leave the machine.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", "adapter_config.json", "adapter_model.safetensors")
_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
                    "chat_template.*", "preprocessor_config.json", "processor_config.json")
# A checkpoint's Hugging Face files: the model, its tokenizer and the files transformers' Trainer reads back from it.
# (A checkpoint save pushes the whole folder, resume state included, as transformers does.)
CHECKPOINT_FILES = (*MODEL_FILES, *_TOKENIZER_FILES, "trainer_state.json", "training_args.json")


class HubPusher:
    """One run's uploads to one Hub repository (created, or reused, on first use).

    Args:
        repo_id: ``"user/name"`` or ``"name"`` (the Hub puts it under the token's user).
        strategy: one of :data:`HUB_STRATEGIES`.
        token, private, revision: passed to ``huggingface_hub`` (``hub_token``, ``hub_private_repo``,
            ``hub_revision``).
        always_push: upload at every save even while the previous upload still runs (``hub_always_push``).
        api: an ``HfApi``-like object (tests pass a recorder); default ``huggingface_hub.HfApi()``.
    """

    def __init__(self, repo_id: str, strategy: str = "every_save", token: str | None = None,
                 private: bool | None = None, revision: str | None = None, always_push: bool = False,
                 api: Any = None):
        strategy = str(getattr(strategy, "value", strategy))
        if strategy not in HUB_STRATEGIES:
            raise ValueError(f"hub_strategy={strategy!r} is not one of {HUB_STRATEGIES}"
                             f"{did_you_mean(strategy, HUB_STRATEGIES)}")
        if not repo_id or not isinstance(repo_id, str):
            raise ValueError(f"hub_model_id={repo_id!r}: name the Hub repository, e.g. 'user/my-model'")
        self.repo_id, self.strategy, self.token = repo_id, strategy, token
        self.private, self.revision, self.always_push = private, revision, always_push
        self._api = api
        self._created = False
        self._pending: list[Future] = []
        self._reading: list[tuple[Future, Path]] = []  # checkpoint uploads and the folder each reads

    @classmethod
    def from_args(cls, args: Any, api: Any = None) -> HubPusher:
        """A pusher for TrainingArguments-like ``args`` (``hub_model_id`` defaults to ``output_dir``'s name)."""
        repo_id = getattr(args, "hub_model_id", None) or Path(str(args.output_dir)).absolute().name
        return cls(repo_id, getattr(args, "hub_strategy", "every_save"), getattr(args, "hub_token", None),
                   getattr(args, "hub_private_repo", None), getattr(args, "hub_revision", None),
                   bool(getattr(args, "hub_always_push", False)), api)

    @property
    def api(self) -> Any:
        if self._api is None:
            try:
                from huggingface_hub import HfApi
            except ImportError:
                raise ImportError("push_to_hub=True uploads through the huggingface_hub package: "
                                  "pip install huggingface_hub") from None
            self._api = HfApi(token=self.token)
        return self._api

    def create_repo(self) -> str:
        """Create the repository if it does not exist (once per run); returns its id as the Hub names it."""
        if not self._created:
            url = self.api.create_repo(self.repo_id, token=self.token, private=self.private, exist_ok=True)
            self.repo_id = getattr(url, "repo_id", None) or self.repo_id
            self._created = True
        return self.repo_id

    def busy(self) -> bool:
        """Whether an upload started earlier is still running."""
        self._pending = [f for f in self._pending if not f.done()]
        return bool(self._pending)

    def would_push(self) -> bool:
        """Whether a save now starts an upload (not under ``"end"``, nor while one runs without ``always_push``)."""
        return self.strategy != "end" and (self.always_push or not self.busy())

    def push_save(self, output_dir: str | Path, checkpoint_dir: str | Path | None = None,
                  commit_message: str | None = None) -> list[Future]:
        """After a save: start the uploads ``strategy`` asks for, in the background; returns their futures.

        Args:
            output_dir: the run's folder (its model files are uploaded; a checkpoint's are copied there first).
            checkpoint_dir: the complete checkpoint folder just written (``output_dir/checkpoint-N``), if any.
            commit_message: the model upload's ("Training in progress, step 500" from the Trainer, as
                transformers words it); the checkpoint's adds ", checkpoint".
        """
        if self.strategy == "end":
            return []
        if not self.would_push():
            log.info("shardkit: the previous upload to %s still runs; this save is not pushed (hub_always_push=True "
                     "pushes every save)", self.repo_id)
            return []
        self.create_repo()
        if commit_message is None:
            step = Path(checkpoint_dir).name if checkpoint_dir is not None else "the model"
            commit_message = f"Training in progress, {step}"
        if checkpoint_dir is not None:
            _copy_model_files(Path(checkpoint_dir), Path(output_dir))
        started = [self._upload(output_dir, commit_message, ignore=_OUTPUT_IGNORE)]
        if checkpoint_dir is not None and self.strategy in ("checkpoint", "all_checkpoints"):
            path_in_repo = "last-checkpoint" if self.strategy == "checkpoint" else Path(checkpoint_dir).name
            started.append(self._upload(checkpoint_dir, f"{commit_message}, checkpoint", path_in_repo=path_in_repo))
            self._reading.append((started[-1], Path(checkpoint_dir).resolve()))
        self._pending.extend(started)
        return started

    def wait_for_folder(self, folder: str | Path) -> None:
        """Block until no upload still reads ``folder``: a checkpoint rotation is about to delete it (an upload of
        a deleted folder would fail or commit half of it). An upload that failed raises later, in :meth:`wait`."""
        folder = Path(folder).resolve()
        self._reading = [(f, p) for f, p in self._reading if not f.done()]
        for future, path in self._reading:
            if path == folder:
                concurrent.futures.wait([future])

    def push_final(self, output_dir: str | Path, commit_message: str = "End of training",
                   blocking: bool = True, allow_patterns: list[str] | str | None = None,
                   ignore_patterns: list[str] | str | None = None) -> Any:
        """Upload ``output_dir`` (not its checkpoints) after the uploads still running; ``blocking=False`` returns
        the upload's future instead of its result. ``allow_patterns`` keeps only the files matching one of them;
        ``ignore_patterns`` leaves out more than the checkpoints and the ``_*`` files (hidden files and links
        leaving ``output_dir`` are left out whatever the patterns say)."""
        self.wait()
        self.create_repo()
        future = self._upload(output_dir, commit_message, ignore=[*_OUTPUT_IGNORE, *_as_list(ignore_patterns)],
                              allow=_as_list(allow_patterns) or None)
        if blocking:
            return future.result()
        self._pending.append(future)
        return future

    def wait(self) -> None:
        """Wait for every upload started so far; an upload that failed raises here."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _upload(self, folder: str | Path, message: str, path_in_repo: str | None = None,
                ignore: list[str] | None = None, allow: list[str] | None = None) -> Future:
        # upload_folder would send every file its patterns let through, hidden ones and link targets included: it is
        # given the exact list chosen here (each name escaped, so a "[" or "*" in a name matches only itself).
        files = files_to_upload(folder, allow, ignore)
        log.info("shardkit: uploading %d file(s) from %s to %s%s: %s", len(files), folder, self.repo_id,
                 f"/{path_in_repo}" if path_in_repo else "", ", ".join(files) or "(none)")
        return self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                      commit_message=message, token=self.token, revision=self.revision,
                                      ignore_patterns=ignore, allow_patterns=[glob.escape(f) for f in files],
                                      run_as_future=True)


def _as_list(patterns: list[str] | str | None) -> list[str]:
    return [patterns] if isinstance(patterns, str) else list(patterns or [])


def _matches(path: str, patterns: list[str]) -> bool:
    # As huggingface_hub's filter_repo_objects: fnmatch on the relative path, a pattern ending in "/" is a folder.
    return any(fnmatch.fnmatch(path, p + "*" if p.endswith("/") else p) for p in patterns)


def files_to_upload(folder: str | Path, allow: list[str] | None = None, ignore: list[str] | None = None) -> list[str]:
    """The files under ``folder`` an upload sends (paths relative to it, ``/``-separated, sorted).

    Left out: what ``ignore`` matches or ``allow`` (when given) does not; every hidden file or folder (a name
    starting with "."); every link to a folder; every link whose target resolves outside ``folder``. The hidden
    files and the links are named in a warning, with the reason."""
    root = Path(folder).resolve()
    files: list[str] = []
    left_out: list[str] = []
    for current, dirs, names in os.walk(root, followlinks=False):
        here = Path(current)
        rel = here.relative_to(root).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        for name in list(dirs):
            if name.startswith(".") or (here / name).is_symlink():
                dirs.remove(name)
                left_out.append(f"{prefix}{name}/ (a hidden folder)" if name.startswith(".") else
                                f"{prefix}{name}/ (a link to the folder {os.path.realpath(here / name)}, not followed)")
        for name in names:
            path, rel_name = here / name, f"{prefix}{name}"
            if name.startswith("."):
                left_out.append(f"{rel_name} (a hidden file)")
                continue
            if path.is_symlink():
                target = Path(os.path.realpath(path))
                if not target.is_relative_to(root):
                    left_out.append(f"{rel_name} (a link to {target}, outside {root})")
                    continue
                if any(part.startswith(".") for part in target.relative_to(root).parts):
                    left_out.append(f"{rel_name} (a link to the hidden {target})")
                    continue
            if path.is_file():
                files.append(rel_name)
    if left_out:
        log.warning("shardkit: not uploaded to the Hub from %s: %s", root, "; ".join(sorted(left_out)))
    return sorted(f for f in files if not _matches(f, ignore or []) and (not allow or _matches(f, allow)))


def _copy_model_files(checkpoint_dir: Path, output_dir: Path) -> None:
    """Put the checkpoint's model and tokenizer files in ``output_dir`` (as transformers does, no second gather of
    the weights). A copy, not a hard link: a later save_model writing config.json in place would change the
    checkpoint too. Each lands under a temporary name and is renamed over the old one, so an upload still reading
    the previous file keeps reading it whole."""
    names = {p.name for pattern in (*MODEL_FILES, *_TOKENIZER_FILES) for p in checkpoint_dir.glob(pattern)}
    for name in sorted(names):
        source = checkpoint_dir / name
        if source.is_symlink() or not source.is_file():
            continue
        staged = output_dir / f"_{name}.staging"
        shutil.copyfile(source, staged)
        os.replace(staged, output_dir / name)
