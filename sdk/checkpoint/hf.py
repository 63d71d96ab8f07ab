"""Hugging Face-format weights into and out of a model set up under any strategy, one module at a time.

    runner.setup(model, ...)
    save_pretrained(runner, "export/", model, dtype=torch.bfloat16, max_shard_size="2GB")   # on every rank

The main process receives the full tensors from :meth:`Runner.iter_full_state_dict` (which gathers one
module at a time) and writes them into safetensors shards as they arrive: no rank ever holds more than
one output shard plus one module. Tied weights are written once, as ``save_pretrained`` does, and an HF
model's ``config.json`` (and generation config) is written beside them, so ``from_pretrained`` loads
the directory.

:func:`load_pretrained` goes the other way: an HF checkpoint directory into a model already set up
(sharded) under any strategy, one module at a time. Under ZeRO-3 each rank reads only its own
partition of each parameter from the files (safetensors slices) straight into it. Elsewhere (FSDP, TP,
replicated strategies, ZeRO-3's persistent small parameters) the main process reads each module's
tensors into the module's gathered parameters and the strategy scatters them on leaving the gather
(``gathered_parameters(modifier_rank=0)``). No rank ever holds the whole model: the peak is one
module gathered plus its tensors read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardkit.utils.partitioned import full_shape, own_slice

from .consolidate import parse_size, write_safetensors_file
from .expert_layout import layout_for, stacked_view
from .export import EXPORT_RE, Export, export_error
from .format import CheckpointError, naming
from .hf_reader import INDEX, SINGLE, HFWeights
from .llama_hf import write_hf_config
from .trust import check_cast

__all__ = ["load_pretrained", "save_pretrained"]


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """alias -> first name, for parameters registered under several names (tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


class _ShardBuffer:
    """Collects tensors until the next one would pass the limit, then writes them as one temporary file."""

    def __init__(self, out_dir: Path, limit: int, meta: dict[str, str]) -> None:
        self.out_dir, self.limit, self.meta = out_dir, limit, meta
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[Path, list[str], int]] = []  # (temporary path, keys, bytes)

    def add(self, key: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.limit:
            self.flush()
        self.pending[key] = t
        self.size += n

    def flush(self) -> None:
        if not self.pending:
            return
        tmp = self.out_dir / f"model-{len(self.files) + 1:05d}.safetensors.partial"  # renamed once N is known
        specs = [(k, t.dtype, tuple(t.shape)) for k, t in self.pending.items()]
        write_safetensors_file(tmp, specs, self.meta, self.pending.pop)
        self.files.append((tmp, [k for k, _, _ in specs], self.size))
        self.pending, self.size = {}, 0

    def finish(self) -> list[str]:
        """Renames the temporary files to model.safetensors or model-0000K-of-0000N + the index; returns the
        names (the index last)."""
        self.flush()
        n = len(self.files)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for (tmp, _, _), name in zip(self.files, names):
            os.replace(tmp, self.out_dir / name)
        if n > 1:
            tied = json.loads(self.meta.get("tied_weights", "{}"))
            index = {"metadata": {"total_size": sum(s for _, _, s in self.files), **({"tied_weights": tied} if tied
                                                                                      else {})},
                     "weight_map": {k: name for (_, keys, _), name in zip(self.files, names) for k in keys}}
            with naming(self.out_dir / INDEX):
                (self.out_dir / INDEX).write_bytes(json.dumps(index, indent=2).encode())
            names.append(INDEX)
        return names


def _save_config(module: nn.Module, out_dir: Path) -> list[str]:
    names = []
    for attr, file in (("config", "config.json"), ("generation_config", "generation_config.json")):
        cfg = getattr(module, attr, None)
        if cfg is not None and hasattr(cfg, "save_pretrained"):
            cfg.save_pretrained(out_dir)
            if (out_dir / file).is_file():
                names.append(file)
    return names


def save_pretrained(runner: Any, out_dir: str | os.PathLike, model: nn.Module, *,
                    dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
                    save_config: bool = True, tensors: Any = None, save_original_format: bool = True,
                    as_transformers: bool = True) -> list[Path]:
    """Writes the whole model as HF-style safetensors (sharded with an index past ``max_shard_size``).

    Call it on every rank (the gathers are collectives). Works under every strategy; under ZeRO-3 this is
    DeepSpeed's ``stage3_gather_16bit_weights_on_model_save`` case without holding the model on rank 0.

    Args:
        runner: the :class:`shardkit.Runner` the model was set up with.
        out_dir: the directory to write (created). It is published atomically: a previous export there stays
            whole until the new one is (other files in it are kept); a checkpoint directory is refused.
        model: the model ``runner.setup`` returned.
        dtype: dtype of floating tensors (e.g. ``torch.bfloat16`` for 16-bit, ``torch.float32``); None
            keeps the dtype the model holds.
        max_shard_size: largest output file (``"5GB"``, ``"500MiB"`` or bytes).
        save_config: also write an HF model's ``config.json`` / ``generation_config.json``.
        tensors: ``(name, tensor)`` pairs to write instead of ``runner.iter_full_state_dict(model)`` (a stream
            built on it, e.g. LoRA adapters merged in by ``shardkit.trainer.peft_support.merged_tensors``).
        save_original_format: as transformers' ``save_pretrained``: an HF Qwen2-MoE / Qwen3-MoE / Mixtral model's
            stacked expert weights are written one tensor per expert and projection, the layout of the Hub's files
            (:mod:`.expert_layout`); False writes them stacked, as the model holds them. Other models are
            unaffected.

    shardkit's own Llama (``shardkit.models.Llama``) is written as the transformers architecture that computes the
    same function, with its ``config.json`` (:mod:`.llama_hf`: dense as ``LlamaForCausalLM``, MoE as Mixtral,
    Qwen2-MoE or GLM4-MoE); a config none computes exactly is a ``CheckpointError`` naming the field. With
    ``as_transformers=False`` it is written under its own names instead (as a checkpoint's ``model.safetensors``
    holds it).

    Returns:
        On the main process the weight files written (shards, then the index); ``[]`` on the other ranks.

    Raises:
        CheckpointError: on every rank, when the main process could not write the export (naming the file).
    """
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {max_shard_size!r}")
    main = runner.is_main_process
    module = runner.unwrap_model(model)
    tied = tied_aliases(module)
    layout = layout_for(getattr(getattr(module, "config", None), "model_type", None)) if save_original_format else None
    # shardkit's Llama has no config a transformers class reads: it is written as the architecture it equals
    # (llama_hf; refused by name, on every rank, before any gather, where none is exact)
    llama = module.hf_export() if as_transformers and callable(getattr(module, "hf_export", None)) else None
    meta_tied = tied if llama is None else llama.aliases(tied, on_disk=save_original_format)
    export = buffer = failure = None
    if main:
        try:
            export = Export(out_dir)
            buffer = _ShardBuffer(export.stage, limit, {"format": "pt",
                                                        **({"tied_weights": json.dumps(meta_tied)} if tied else {})})
        except CheckpointError as e:
            failure = e
    stream = runner.iter_full_state_dict(model) if tensors is None else tensors
    for name, tensor in stream:  # every rank drives it (the gathers), even after the main one failed to write
        if failure is not None or name in tied:
            continue
        if dtype is not None and tensor.is_floating_point() and not (llama is not None and llama.keeps_fp32(name)):
            tensor = tensor.to(dtype)
        try:
            if llama is not None:
                pieces = llama.on_disk(name, tensor) if save_original_format else llama.tensors(name, tensor)
            else:
                pieces = layout.split(name, tensor) if layout is not None else [(name, tensor)]
            for out_name, piece in pieces:
                buffer.add(out_name, piece)
        except (OSError, CheckpointError) as e:
            failure = e
    written: list[Path] = []
    if main and failure is None:
        try:
            names = buffer.finish()
            if save_config:
                names += _save_config(module, export.stage) if llama is None else \
                    write_hf_config(export.stage, llama.config, dtype or _floating_dtype(module))
            written = [f for f in export.commit(names) if EXPORT_RE.match(f.name)]
        except (OSError, CheckpointError) as e:
            failure = e
    return _settle(runner, export, failure, written)


def _floating_dtype(module: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def _settle(runner: Any, export: Export | None, failure: BaseException | None, written: list[Path]) -> list[Path]:
    """Every rank learns whether the main one published the export; all raise if it did not."""
    if isinstance(failure, OSError):
        failure = export_error(export.out, failure)
    if export is not None and failure is not None:
        export.abort()
    message = runner.broadcast(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"save_pretrained failed on the main process: {message}")
    return written


def _modules(module: nn.Module, prefix: str = ""):
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _modules(child, f"{prefix}{name}.")


def _copy_checked(key: str, target: torch.Tensor, value: torch.Tensor, where: Path) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise CheckpointError(f"{where}: {key} has shape {list(value.shape)} in the checkpoint, "
                              f"{list(target.shape)} in the model")
    with torch.no_grad():
        target.copy_(value)


def _load_own_slice(key: str, p: torch.Tensor, piece: tuple[int, torch.Tensor], weights: HFWeights) -> None:
    """Reads this rank's run of ``key`` (``utils.partitioned.own_slice``) from the file into its partition."""
    shape = full_shape(p)
    if weights.shape(key) != shape:
        raise CheckpointError(f"{weights.path}: {key} has shape {list(weights.shape(key))} in the checkpoint, "
                              f"{list(shape)} in the model")
    start, values = piece
    if values.numel():
        with torch.no_grad():
            values.copy_(weights.read_flat(key, start, values.numel()))


def _check_all(weights: HFWeights, module: nn.Module, tied: dict[str, str]) -> None:
    """Every shape and dtype checked against the model from the headers alone, on every rank, before any
    tensor is loaded: a bad file fails the same way everywhere and leaves the model untouched."""
    for prefix, sub in _modules(module):
        for k, t in [*sub._parameters.items(), *sub._buffers.items()]:
            key = prefix + k
            if t is None or key in tied or key not in weights.weight_map:
                continue
            shape = full_shape(t)  # a DTensor's global shape, a partitioned parameter's whole one
            if weights.shape(key) != shape:
                raise CheckpointError(f"{weights.file_path(key)}: {key} has shape {list(weights.shape(key))} in the "
                                      f"checkpoint, {list(shape)} in the model")
            check_cast(weights.dtype(key), t.dtype, str(weights.file_path(key)), key)


def load_pretrained(runner: Any, model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> list[str]:
    """Loads an HF safetensors checkpoint directory into ``model`` set up (sharded or not) under ``runner``.

    Call on every rank (the gathers are collectives). Tied parameters missing from the files (HF drops
    ``lm_head.weight`` when tied) are filled through the tie. The directory is read under the rules of
    every shardkit reader (:mod:`.hf_reader`); every shape and dtype is checked before anything loads, and
    values are cast only between float32 and float16/bfloat16 (int64 or bool data in a float parameter, or
    fp16 <-> bf16, is refused). MoE experts stored one tensor per expert (the Hub's Qwen2-MoE / Qwen3-MoE / Mixtral
    files, :func:`save_pretrained`'s default) load into the model's stacked expert weights; shardkit's Llama reads
    the transformers form :func:`save_pretrained` writes for it (or an older export under its own names).

    Args:
        runner: the :class:`shardkit.Runner` the model was set up with.
        model: the model ``runner.setup`` returned.
        path: the directory holding ``model.safetensors`` or ``model.safetensors.index.json`` + shards.
        strict: raise when the model has keys the files lack, or the files keys the model lacks.

    Returns:
        The model's keys the files lacked (empty under ``strict``).
    """
    path = Path(path)
    module = runner.unwrap_model(model)
    tied = tied_aliases(module)
    # Hub-layout MoE files (one tensor per expert) read as the stacked expert weights the model holds
    shapes = {prefix + k: full_shape(t) for prefix, sub in _modules(module) for k, t in sub._parameters.items()
              if t is not None}
    weights = HFWeights(path)
    if callable(getattr(module, "hf_export", None)) and any(k.startswith("model.") for k in weights.weight_map):
        # shardkit's Llama exported as a transformers model: its names and transforms undone
        buffers = {prefix + k: tuple(b.shape) for prefix, sub in _modules(module) for k, b in sub._buffers.items()
                   if b is not None and k not in sub._non_persistent_buffers_set}
        weights = module.hf_export().files_view(weights, {**shapes, **buffers})
    else:
        weights = stacked_view(weights, shapes)
    own = [k for k in module.state_dict() if k not in tied]
    missing = [k for k in own if k not in weights.weight_map]
    unexpected = [k for k in weights.weight_map if k not in own and k not in tied]
    if strict and (missing or unexpected):
        raise CheckpointError(f"{path}: does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
                              "; pass strict=False to load what matches")
    _check_all(weights, module, tied)
    main = runner.is_main_process
    for prefix, sub in _modules(module):
        named = [(prefix + n, p) for n, p in sub._parameters.items() if p is not None and prefix + n not in tied]
        named = [(k, p) for k, p in named if k in weights.weight_map]
        pieces = {k: own_slice(p) for k, p in named}
        for k, p in named:  # each rank reads its own partition: nothing gathered, nothing scattered
            if pieces[k] is not None:
                _load_own_slice(k, p, pieces[k], weights)
        named = [(k, p) for k, p in named if pieces[k] is None]
        if named:
            with runner.gathered_parameters([p for _, p in named], modifier_rank=0) as whole:
                if main:
                    for (k, _), target in zip(named, whole):
                        _copy_checked(k, target, weights.get(k), path)
        for n, b in sub._buffers.items():  # buffers are never sharded: every rank reads its own
            if b is not None and prefix + n in weights.weight_map:
                _copy_checked(prefix + n, b, weights.get(prefix + n), path)
    # DeepSpeed's optimizers keep fp32 master copies made at setup; the next step would write them back over
    # the loaded weights, so they are refreshed from the parameters (torch engines have no separate copy).
    refresh = getattr(getattr(model, "optimizer", None), "refresh_fp32_params", None)
    if callable(refresh):
        refresh()
    runner.barrier("load_pretrained")
    return missing
