"""Consolidating shardkit and DeepSpeed checkpoints into Hugging Face-style safetensors (the zero-to-fp32 tool)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import torch

from shardkit.utils.partitioned import full_shape, gathered_for_write

from .deepspeed_reader import DeepSpeedCheckpoint, ZeroFp32StateDict, find_deepspeed_checkpoint
from .expert_layout import ExpertLayout, export_plan, layout_for, model_type_of
from .export import EXPORT_RE, copy_model_files, publish_export
from .format import CheckpointError, dtype_tag, fsync_path, naming
from .hf_reader import INDEX
from .llama_hf import LlamaExport, model_config_entry, write_hf_config
from .reader import CheckpointReader
from .trust import check_cast, check_child_dir

__all__ = ["consolidate", "consolidate_deepspeed", "get_fp32_state_dict", "llama_export_of",
           "load_state_dict_from_zero_checkpoint", "parse_size", "write_hf_shards", "write_llama",
           "write_safetensors_file"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Parses ``"5GB"`` (10**9, as Hugging Face does), ``"500MiB"`` (2**20) or a plain byte count."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    unit = m.group(2).upper() if m else ""
    if not m or (unit and unit not in _UNITS):
        raise CheckpointError(f"max_shard_size {size!r} is not a size; use e.g. 5GB, 500MB, 2GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[unit or "B"])


def _plan(keys: dict, dtype: torch.dtype | None, limit: int,
          keep: Callable[[str], bool] = lambda key: False) -> list[list[tuple[str, torch.dtype, tuple]]]:
    """Greedy packing in key order; a tensor bigger than the limit gets a shard of its own."""
    shards: list[list[tuple[str, torch.dtype, tuple]]] = [[]]
    size = 0
    for key, (shape, src) in keys.items():
        out = dtype if dtype is not None and src.is_floating_point and not keep(key) else src
        n = torch.Size(shape).numel() * torch.empty((), dtype=out).element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((key, out, tuple(shape)))
        size += n
    return shards


def write_safetensors_file(path: Path, specs: list[tuple[str, torch.dtype, tuple]], meta: dict[str, str],
                           fetch: Callable[[str], torch.Tensor], sync: bool = True) -> None:
    """One safetensors file, tensor by tensor (header first: the specs fix every offset), then fsync.

    Unlike the checkpoint writer it does not hash: an export is verified by loading it, and hashing
    every byte costs seconds per GB for nothing the output format keeps.
    """
    header: dict = {"__metadata__": meta}
    offset = 0
    for key, dtype, shape in specs:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": dtype_tag(dtype, f"{path.name}:{key}"), "shape": list(shape),
                       "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with naming(path), open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for key, dtype, shape in specs:
            t = fetch(key).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"{path.name}: {key} has shape {list(t.shape)}, planned {list(shape)}")
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            del t
        f.flush()
        if sync:
            os.fsync(f.fileno())


def write_hf_shards(out_dir: Path, keys: dict[str, tuple[tuple, torch.dtype]], fetch: Callable[[str], torch.Tensor],
                    *, dtype: torch.dtype | None, max_shard_size: int | str, tied: dict[str, str],
                    keep: Callable[[str], bool] = lambda key: False) -> list[str]:
    """Writes ``keys`` (name -> (shape, source dtype)) into the fresh directory ``out_dir`` as
    ``model.safetensors`` or shards + index; returns the file names (the index last), not yet fsynced.

    ``fetch(name)`` returns one tensor; only one is held at a time. Floating tensors are cast to
    ``dtype`` (None keeps them), but those ``keep(name)`` is true of. ``tied`` (alias -> kept name) goes into the
    metadata and index. The caller publishes the directory (:func:`shardkit.checkpoint.export.publish_export`).
    """
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {max_shard_size!r}")
    shards = _plan(keys, dtype, limit, keep)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    meta = {"format": "pt"}
    if tied:
        meta["tied_weights"] = json.dumps(tied)
    # Each file's fsync runs on a thread while the next file is written: fsync waits on the disk with the GIL
    # released, and it was 13% of a 1 GB conversion done in line. The export's own fsyncs then find them clean.
    with ThreadPoolExecutor(max_workers=1) as syncer:
        pending = []
        try:
            for file, specs in zip(names, shards):
                write_safetensors_file(out_dir / file, specs, meta, fetch, sync=False)
                pending.append(syncer.submit(fsync_path, out_dir / file))
        finally:
            wait(pending)
        for job in pending:
            job.result()
    if n > 1:
        total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for sh in shards for _, d, s in sh)
        index = {"metadata": {"total_size": total, **({"tied_weights": tied} if tied else {})},
                 "weight_map": {k: f for f, sh in zip(names, shards) for k, _, _ in sh}}
        with naming(out_dir / INDEX):
            (out_dir / INDEX).write_bytes(json.dumps(index, indent=2).encode())
        names.append(INDEX)
    return names


def llama_export_of(reader: Any, name: str) -> LlamaExport | None:
    """The HF form of the module entry ``name`` when the checkpoint records it as a shardkit Llama, else None."""
    entry = model_config_entry(name)
    if not reader.has(entry):
        return None
    try:
        return LlamaExport(reader.read_json(entry))
    except CheckpointError as e:
        raise CheckpointError(f"{reader.path}: {e}") from None


def write_llama(llama: LlamaExport, stage: Path, keys: dict[str, tuple[tuple, torch.dtype]],
                fetch: Callable[[str], torch.Tensor], tied: dict[str, str], copied: list[str], *,
                dtype: torch.dtype | None, max_shard_size: int | str, original_format: bool) -> list[str]:
    """A shardkit Llama's weights as the transformers model they equal, and that model's config.json (in place of
    any config.json found beside the checkpoint: the recorded config is the model's)."""
    hf_keys, hf_fetch = llama.plan(keys, fetch)
    layout = llama.layout if original_format else None
    out_keys, out_fetch = export_plan(hf_keys, hf_fetch, layout)
    names = write_hf_shards(stage, out_keys, out_fetch, dtype=dtype, max_shard_size=max_shard_size,
                            tied=llama.aliases(tied, on_disk=original_format), keep=llama.keeps_fp32)
    weights = dtype or next((d for _, d in keys.values() if d.is_floating_point), None)
    return names + [n for n in copied if n != "config.json"] + write_hf_config(stage, llama.config, weights)


def _renamed(tied: dict[str, str], layout: ExpertLayout | None) -> dict[str, str]:
    return tied if layout is None else {layout.rename(a): layout.rename(k) for a, k in tied.items()}


def _weights(paths: list[Path]) -> list[Path]:
    return [p for p in paths if EXPORT_RE.match(p.name)]


def consolidate(checkpoint_path: str | os.PathLike, output_dir: str | os.PathLike, *, name: str = "model",
                dtype: torch.dtype | None = torch.float32, max_shard_size: int | str = "5GB",
                original_format: bool = True, as_transformers: bool = True) -> list[Path]:
    """Writes entry ``name`` of a checkpoint (full or sharded, any world size) as HF-style safetensors.

    Produces ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` plus
    ``model.safetensors.index.json`` when the total exceeds ``max_shard_size``, and copies the model's
    ``config.json``, ``generation_config.json`` and tokenizer files when the checkpoint directory (or the
    directory holding it) has them, so ``from_pretrained`` builds the right model. Streams one tensor
    at a time, so peak memory stays near the largest tensor. Needs no process group and no DeepSpeed.

    Floating tensors are cast to ``dtype`` (``None`` keeps each tensor's dtype); integer and bool
    tensors keep theirs. Tied weights (keys the checkpoint stores as aliases) are written once, under
    the first key, as Hugging Face's ``save_pretrained`` does; the dropped keys are listed in the
    files' metadata and the index under ``"tied_weights"`` (alias -> kept key). With ``original_format`` and a
    ``config.json`` of a Qwen2-MoE / Qwen3-MoE / Mixtral model beside the checkpoint, stacked expert weights are
    written one tensor per expert and projection, as transformers' ``save_pretrained`` writes them
    (:mod:`.expert_layout`); False writes them as the model held them. A checkpoint of shardkit's Llama (which
    records its config) is written as the transformers model it equals, with that model's ``config.json``
    (:mod:`.llama_hf`; refused by name where none is exact; ``as_transformers=False`` writes its own names instead,
    as the model holds them). The output is published
    atomically (:mod:`.export`): a previous export there stays whole until the new one is; the output
    may not be a checkpoint or lie inside the one read.

    Returns:
        The weight files written: the shards, then the index if there is one.
    """
    parse_size(max_shard_size)
    with CheckpointReader(checkpoint_path) as reader:
        if not reader.has(name):
            raise CheckpointError(f"{reader.path}: has no entry {name!r}; it has {sorted(reader.entries())}; "
                                  "pass --name")
        tied = reader.aliases(name)
        keys = {k: v for k, v in reader.sharded_keys(name).items() if k not in tied}
        # a shardkit Llama: refused by name before anything is written
        llama = llama_export_of(reader, name) if as_transformers else None

        def write(stage: Path) -> list[str]:
            copied = copy_model_files([reader.path, reader.path.parent], stage)
            if llama is not None:
                return write_llama(llama, stage, keys, lambda k: reader.read_full(name, k), tied, copied,
                                   dtype=dtype, max_shard_size=max_shard_size, original_format=original_format)
            layout = layout_for(model_type_of(stage)) if original_format else None
            out_keys, fetch = export_plan(keys, lambda k: reader.read_full(name, k), layout)
            names = write_hf_shards(stage, out_keys, fetch, dtype=dtype, max_shard_size=max_shard_size,
                                    tied=_renamed(tied, layout))
            return names + copied

        return _weights(publish_export(output_dir, write, sources=[checkpoint_path, reader.path]))


def consolidate_deepspeed(checkpoint_path: str | os.PathLike, output_dir: str | os.PathLike, *,
                          tag: str | None = None, dtype: torch.dtype | None = torch.float32,
                          max_shard_size: int | str = "5GB", exclude_frozen_parameters: bool = False,
                          original_format: bool = True) -> list[Path]:
    """Writes a DeepSpeed ZeRO-1/2/3 checkpoint as HF-style safetensors, like :func:`consolidate`.

    Never imports DeepSpeed and never runs code from the files (see :mod:`.safe_unpickle`). Every
    rank file is opened and checked before anything is written; then one parameter at a time is read
    from the memory-mapped files and written, so peak memory stays near the largest parameter.
    Shared parameters are written once; the others are listed under ``"tied_weights"``. The model's
    ``config.json`` and tokenizer files are copied from the tag directory or the one holding it (a
    Hugging Face Trainer's ``checkpoint-N``).

    Args:
        checkpoint_path: the directory holding ``latest`` (or the tag directory itself).
        output_dir: where ``model*.safetensors`` go.
        tag: the tag directory (``global_step14``); default: the one ``latest`` names.
        dtype: dtype of floating tensors in the output (None: fp32, as read).
        max_shard_size: largest output file (``"5GB"``, ``"500MiB"``, bytes).
        exclude_frozen_parameters: leave out parameters that were not trained.
        original_format: stacked MoE expert weights one tensor per expert, as :func:`consolidate`.

    Returns:
        The weight files written: the shards, then the index if there is one.
    """
    parse_size(max_shard_size)
    with DeepSpeedCheckpoint(checkpoint_path, tag, exclude_frozen_parameters) as ckpt:
        keys = {k: (tuple(s), d) for k in ckpt.sources for s, d in [ckpt.spec(k)]}

        def write(stage: Path) -> list[str]:
            copied = copy_model_files([ckpt.path, ckpt.path.parent], stage)
            layout = layout_for(model_type_of(stage)) if original_format else None
            out_keys, fetch = export_plan(keys, ckpt.read, layout)
            names = write_hf_shards(stage, out_keys, fetch, dtype=dtype, max_shard_size=max_shard_size,
                                    tied=_renamed(dict(ckpt.aliases), layout))
            return names + copied

        return _weights(publish_export(output_dir, write, sources=[checkpoint_path, ckpt.path]))


class _ShardkitFp32StateDict(Mapping):
    """The lazy mapping over a shardkit checkpoint's ``model`` entry (aliases included, like DeepSpeed's)."""

    def __init__(self, path: Path, name: str = "model") -> None:
        self._reader = CheckpointReader(path)
        self._name = name
        self.aliases = self._reader.aliases(name)
        self._specs = self._reader.sharded_keys(name)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._specs:
            raise KeyError(key)
        t = self._reader.read_full(self._name, self.aliases.get(key, key))
        return t.float() if t.is_floating_point() else t

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def shape(self, key: str) -> torch.Size:
        """The tensor's shape, without reading it."""
        return torch.Size(self._specs[key][0])

    def dtype(self, key: str) -> torch.dtype:
        """The tensor's dtype as a lookup returns it (floating ones fp32), without reading it."""
        dtype = self._specs[key][1]
        return torch.float32 if dtype.is_floating_point else dtype

    def __len__(self) -> int:
        return len(self._specs)


def get_fp32_state_dict(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                        exclude_frozen_parameters: bool = False) -> Mapping[str, torch.Tensor]:
    """A lazy ``{name: tensor}`` of a checkpoint's model: each lookup reads one tensor, floating ones as fp32.

    Works on DeepSpeed ZeRO checkpoints (the values equal DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``) and on shardkit checkpoints. Shared parameters appear
    under each name. ``dict(get_fp32_state_dict(d))`` makes an ordinary state dict.

    Args:
        checkpoint_dir: the directory holding ``latest``, or a checkpoint/tag directory itself.
        tag: a tag directory under ``checkpoint_dir`` (``global_step14``); default: ``latest``.
        exclude_frozen_parameters: DeepSpeed only: leave out parameters that were not trained.

    Raises:
        CheckpointError: naming the file and problem (missing rank, truncated file, foreign directory).
    """
    ds = find_deepspeed_checkpoint(checkpoint_dir, tag)
    if ds is not None:
        return ZeroFp32StateDict(DeepSpeedCheckpoint(ds, exclude_frozen_parameters=exclude_frozen_parameters))
    return _ShardkitFp32StateDict(check_child_dir(Path(checkpoint_dir), tag, "tag") if tag else Path(checkpoint_dir))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None, strict: bool = False) -> torch.nn.Module:
    """Copies a checkpoint's fp32 weights into ``model`` one tensor at a time; returns ``model``.

    Unlike DeepSpeed's function of the same name the model stays on its device and the full state
    dict is never built, and values are cast only between fp32 and 16-bit floats (int64 data into a
    float parameter is refused). Keys the model lacks, or that the checkpoint lacks, are an error only with
    ``strict=True`` (DeepSpeed loads with ``strict=False``).

    A model whose parameters an engine still partitions (a ZeRO-3 Trainer's ``trainer.model``) is loaded
    partition by partition: each parameter is gathered, written and partitioned again, so the model stays
    usable where it is (a forward, ``generate``, a save). Call it on every rank then (the gathers are
    collectives). Every shape is checked against the model before anything is written.
    """
    sd = get_fp32_state_dict(checkpoint_dir, tag)
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if strict and (missing or unexpected):
        raise CheckpointError(f"{checkpoint_dir}: does not match the model: missing {missing[:10]}, "
                              f"unexpected {unexpected[:10]}; pass strict=False to load what matches")
    found = [(k, target) for k, target in own.items() if k in sd]
    for k, target in found:  # on every rank, before any gather: a bad file fails everywhere, nothing written
        if tuple(sd.shape(k)) != full_shape(target):
            raise CheckpointError(f"{checkpoint_dir}: {k} has shape {list(sd.shape(k))} in the checkpoint, "
                                  f"{list(full_shape(target))} in the model")
        check_cast(sd.dtype(k), target.dtype, str(checkpoint_dir), k)
    with torch.no_grad():
        for k, target in found:
            value = sd[k]
            with gathered_for_write(target):
                target.copy_(value)
    return model
