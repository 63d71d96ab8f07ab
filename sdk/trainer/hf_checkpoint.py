"""Checkpoints Hugging Face's tools read, and checkpoints Hugging Face's Trainer wrote.

Out: every ``checkpoint-N/`` gets, beside shardkit's exact-resume files, what ``from_pretrained`` loads:
the model's ``config.json`` (and generation config), its weights as ``model.safetensors`` (or shards and an
index), the processing class, and ``trainer_state.json``. Under strategies that keep whole weights on every
rank, shardkit's own ``model.safetensors`` entry already is that file (state-dict names, whole tensors); under
ZeRO, FSDP and TensorParallel the weights are streamed from the shards by ``shardkit.checkpoint.hf``'s writer,
one module at a time, so no rank ever holds the whole model.

In: a ``checkpoint-N/`` written by Hugging Face's Trainer (``model.safetensors`` + ``trainer_state.json`` +
``optimizer.pt`` + ``scheduler.pt``) resumes here. Weights are read from safetensors into the (sharded) model;
the optimizer and scheduler states only through shardkit's capped allowlist reader, which builds tensors and
plain containers and never runs code, and checked against this run's optimizer and scheduler before they are
loaded (:mod:`shardkit.trainer.hf_optimizer_state`). The optimizer's whole-tensor state goes in through the
strategy's ``load_optimizer_state``, the path a full save of shardkit's own takes: under FSDP and ZeRO each rank
loads its shard of the moments, and the resumed run continues the one that wrote the checkpoint.
``rng_state.pth`` and ``training_args.bin`` are full pickles: they are not read (random streams start fresh; the
arguments are this run's).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from torch import nn

from shardkit.checkpoint.format import MANIFEST, CheckpointError
from shardkit.trainer.hf_optimizer_state import checked_optimizer_state, checked_scheduler_state, read_torch_file
from shardkit.trainer.state import TRAINER_STATE_NAME

__all__ = ["hf_decay_parameter_names", "is_hf_checkpoint", "load_hf_checkpoint", "public_permissions",
           "write_hf_files"]

logger = logging.getLogger("shardkit.trainer")

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_MAX_PICKLE_BYTES = 64 << 30  # an optimizer.pt is ~2x the fp32 model; larger is not one
_FORBIDDEN_DECAY = ("bias", "layernorm", "rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def hf_decay_parameter_names(model: nn.Module) -> set[str]:
    """Hugging Face's rule for which parameters get weight decay: not inside a LayerNorm, and no name part
    saying bias or norm (``bias``, ``layernorm``, ``rmsnorm``, ``.norm.``, ``_norm``)."""
    import re

    patterns = [re.compile(p) for p in _FORBIDDEN_DECAY]

    def walk(module: nn.Module) -> list[str]:
        names = []
        for child_name, child in module.named_children():
            for n in walk(child):
                full = f"{child_name}.{n}"
                if not isinstance(child, nn.LayerNorm) and not any(p.search(full.lower()) for p in patterns):
                    names.append(full)
        names += [k for k in module._parameters if not any(p.search(k.lower()) for p in patterns)]
        return names

    return set(walk(model))


def public_permissions(directory: Path, names: list[str] | None = None) -> None:
    """Give files written for people and other tools the mode a plain ``open()`` would (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in (directory / n for n in names) if names is not None else directory.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def write_hf_files(runner: Any, model: nn.Module, path: Path, processing_class: Any = None,
                   data_collator: Any = None) -> None:
    """Add ``from_pretrained``'s files to a saved checkpoint directory. Call on every rank (gathers)."""
    from shardkit.trainer.peft_support import is_peft_model

    module = runner.unwrap_model(model)
    if not is_peft_model(module) and not (path / _WEIGHTS[0]).is_file():
        _stream_weights_into(runner, model, path)
    if runner.is_main_process:
        for attr in ("config", "generation_config"):
            config = getattr(module, attr, None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(path)
        save_processing_class(path, processing_class, data_collator)
        public_permissions(path, [n for n in os.listdir(path) if not n.startswith(".")])
    runner.barrier("trainer-hf-files")


def _stream_weights_into(runner: Any, model: nn.Module, path: Path) -> None:
    """Stream the weights from the shards into a hidden sibling of the checkpoint (an export never writes into a
    checkpoint directory), then move the files in: rename within one folder, no copy."""
    from shardkit.checkpoint.hf import save_pretrained

    stage = path.parent / f".{path.name}.hf-weights"
    if runner.is_main_process and stage.exists():  # left by a run killed mid-save
        shutil.rmtree(stage)
    # a checkpoint's model.safetensors keeps the model's own names (shardkit's Llama too), as the whole-weight
    # strategies' checkpoint entry, which is that file, does
    written = save_pretrained(runner, stage, model, save_config=False, as_transformers=False)
    if runner.is_main_process:
        for file in written:
            os.replace(file, path / file.name)
        shutil.rmtree(stage)


def save_processing_class(path: Path, processing_class: Any, data_collator: Any = None) -> None:
    """The tokenizer/processor, or (as Hugging Face does) the data collator's tokenizer when there is none."""
    target = processing_class
    if target is None:
        target = getattr(data_collator, "tokenizer", None)
    if target is not None and hasattr(target, "save_pretrained"):
        target.save_pretrained(path)


def is_hf_checkpoint(path: Path) -> bool:
    """A checkpoint written by Hugging Face's Trainer: weights and trainer_state.json, no shardkit manifest."""
    return (not (path / MANIFEST).exists() and (path / TRAINER_STATE_NAME).is_file()
            and any((path / w).is_file() for w in _WEIGHTS))


def _pickle_file(path: Path) -> Path | None:
    """``path`` if it is a regular file (not a link) of sane size inside its checkpoint, else None or an error."""
    if not os.path.lexists(path):
        return None
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} must be a regular file inside the checkpoint, not a link or a device")
    if info.st_size > _MAX_PICKLE_BYTES:
        raise CheckpointError(f"{path} is {info.st_size} bytes, more than an optimizer state can be")
    return path


def _hf_order(module: nn.Module) -> list[str]:
    """The trainable parameters' names in the order Hugging Face's optimizer indexes them: decayed ones first."""
    decay = hf_decay_parameter_names(module)
    named = [n for n, p in module.named_parameters() if p.requires_grad]
    return [n for n in named if n in decay] + [n for n in named if n not in decay]


def load_hf_checkpoint(runner: Any, model: nn.Module, optimizer: Any, scheduler: Any, path: Path) -> None:
    """Weights, optimizer and scheduler of a Hugging Face Trainer checkpoint. Call on every rank.

    The optimizer and scheduler files are read and checked before anything is loaded: a refused file leaves the
    model, optimizer and scheduler as they were."""
    from shardkit.checkpoint.hf import load_pretrained

    strategy, module = runner.strategy, runner.unwrap_model(model)
    optimizer_state = scheduler_state = None
    optimizer_file = _pickle_file(path / "optimizer.pt")
    if optimizer_file is not None and optimizer is not None:
        shapes = {n: strategy.parameter_shape(p) for n, p in module.named_parameters()}
        optimizer_state = checked_optimizer_state(read_torch_file(optimizer_file), optimizer_file,
                                                  strategy.named_param_groups(optimizer, model), shapes,
                                                  _hf_order(module), type(optimizer).__name__)
    scheduler_file = _pickle_file(path / "scheduler.pt")
    if scheduler_file is not None and scheduler is not None and hasattr(scheduler, "load_state_dict"):
        scheduler_state = checked_scheduler_state(read_torch_file(scheduler_file), scheduler_file, scheduler)
    load_pretrained(runner, model, path)
    if optimizer_state is not None:  # whole tensors by name: each rank takes its part, at this strategy's layout
        strategy.load_optimizer_state(optimizer, model, optimizer_state)
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
        _learning_rates_from(scheduler)
    if (path / "rng_state.pth").exists():
        logger.info(f"{path / 'rng_state.pth'} is a full pickle and is not read: random streams start fresh")


def _learning_rates_from(scheduler: Any) -> None:
    """The next step runs at the rate the loaded schedule reached (as after Hugging Face's resume), also where the
    checkpoint has no optimizer.pt: a scheduler sets the groups' rates only when it steps."""
    last = getattr(scheduler, "_last_lr", None)
    groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
    if isinstance(last, list) and groups is not None and len(last) == len(groups):
        for group, lr in zip(groups, last):
            group["lr"] = lr
