"""The checkpoint formats shardkit converts between: how each is detected, read and written.

Every readable format is seen through the reads a strategy makes of a shardkit checkpoint
(``sharded_keys``/``read_full``/``read_state``/``read_json``: :class:`~shardkit.checkpoint.CheckpointReader`,
or :class:`~shardkit.checkpoint.dcp_reader.DCPCheckpointView` for DCP), so one writer per target serves every
source, and ``Runner.load`` resumes any of them at any layout. DeepSpeed universal checkpoints go through
``checkpoint/ds_universal.py`` (to and from shardkit's format), imported only when one is met.

===============  ========================================  ======================  =============================
format           detected by                               read as                 written by
===============  ========================================  ======================  =============================
``shardkit``     ``shardkit.json`` (or ``latest``)         CheckpointReader        :func:`write_shardkit`
``dcp``          ``.metadata``                             DCPCheckpointView       :func:`write_dcp`
``ds-universal`` ``ds_universal.is_universal_checkpoint``  via shardkit            ``ds_universal``
``deepspeed``    ``global_stepN/`` rank files, ``latest``  ``--to hf`` only        (not written)
``hf``           ``config.json`` + ``*.safetensors``       (not read)              :func:`write_hf`
===============  ========================================  ======================  =============================
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .consolidate import llama_export_of, write_hf_shards, write_llama
from .dcp_metadata import is_dcp_checkpoint
from .dcp_reader import MODEL, OPTIMIZER, DCPCheckpointView
from .dcp_writer import DCPStreamWriter
from .deepspeed_reader import find_deepspeed_checkpoint
from .expert_layout import export_plan, layout_for, model_type_of
from .export import copy_model_files
from .format import MANIFEST, CheckpointError
from .llama_hf import model_config_entry
from .reader import CheckpointReader, resolve_checkpoint
from .writer import CheckpointWriter

__all__ = ["READABLE", "TARGETS", "detect_format", "open_checkpoint", "universal", "write_dcp", "write_hf",
           "write_shardkit"]

TARGETS = ("shardkit", "dcp", "hf", "ds-universal")
READABLE = ("shardkit", "dcp", "ds-universal", "deepspeed")
Tick = Callable[[torch.Tensor], torch.Tensor]  # counts a tensor on the progress bar and hands it on
_SEP = "/"


def universal() -> Any:
    """The DeepSpeed universal checkpoint module, or a CheckpointError saying it is not available."""
    try:
        from . import ds_universal  # deferred: an optional format, imported when one is met
    except ImportError as e:
        raise CheckpointError(f"DeepSpeed universal checkpoints are not available in this build ({e}); convert "
                              "through DeepSpeed's own ds_to_universal / a shardkit checkpoint instead") from None
    return ds_universal


def _is_universal(path: Path) -> bool:
    try:
        return bool(universal().is_universal_checkpoint(path))
    except CheckpointError:
        return False


def detect_format(path: str | os.PathLike) -> str:
    """The format of the checkpoint at ``path`` (one of :data:`READABLE`, or ``hf``).

    Raises:
        CheckpointError: naming the path when it is none of them.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if (path / MANIFEST).is_file() or (path / "latest").is_file() and _shardkit(path):
        return "shardkit"
    if is_dcp_checkpoint(path):
        return "dcp"
    if path.is_dir() and _is_universal(path):
        return "ds-universal"
    if find_deepspeed_checkpoint(path) is not None:
        return "deepspeed"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "hf"
    raise CheckpointError(f"{path}: is not a checkpoint shardkit knows (a shardkit checkpoint with shardkit.json, a "
                          "torch.distributed.checkpoint directory with .metadata, a DeepSpeed universal or ZeRO "
                          "checkpoint, or a Hugging Face model directory)")


def _shardkit(path: Path) -> bool:
    try:
        resolve_checkpoint(path)
    except CheckpointError:
        return False
    return True


def open_checkpoint(path: str | os.PathLike, verify: bool = True) -> Any:
    """A reader of a shardkit checkpoint or a DCP directory, answering the same reads (see the module docstring)."""
    if not (Path(path) / MANIFEST).is_file() and is_dcp_checkpoint(path):
        return DCPCheckpointView(path)
    return CheckpointReader(path, verify=verify)


# ---- what a source holds -------------------------------------------------------------------------------------


def _named(source: Any, kind: str, preferred: str) -> str | None:
    """The entry holding the source's module (or optimizer): ``preferred``, else its only one of that kind."""
    kinds = source.read_json("entries") if source.has("entries") else {}
    if kinds.get(preferred) == kind:
        return preferred
    found = [k for k, v in kinds.items() if v == kind]
    if len(found) > 1:
        raise CheckpointError(f"{source.path}: holds {len(found)} {kind}s ({found}); a conversion takes the one "
                              f"called {preferred!r}")
    return found[0] if found else None


def optimizer_parts(source: Any, name: str) -> tuple[dict[str, Any], dict[str, tuple], Callable[[str], Any]]:
    """The optimizer entry ``name`` as (meta with param_groups/scalars/tensor_keys/step, its tensor keys ->
    (shape, dtype), fetch(key)), for a sharded entry (tensors read one by one) or a full one (read whole)."""
    if source.has(f"{name}.meta"):
        meta = source.read_state(f"{name}.meta")
        return meta, source.sharded_keys(name), lambda k: source.read_full(name, k)
    nested = source.read_state(name)  # a full save (SingleDevice/DDP): one file, read whole
    tensors = {f"{fqn}{_SEP}{k}": v for fqn, st in nested["state"].items() for k, v in st.items()
               if isinstance(v, torch.Tensor) and v.dim() > 0}
    scalars = {fqn: {k: v for k, v in st.items() if f"{fqn}{_SEP}{k}" not in tensors}
               for fqn, st in nested["state"].items()}
    keys = {fqn: sorted(k for k in st if f"{fqn}{_SEP}{k}" in tensors) for fqn, st in nested["state"].items()}
    step = next((s["step"] for s in scalars.values() if "step" in s), 0)
    meta = {"param_groups": nested["param_groups"], "scalars": scalars, "tensor_keys": keys,
            "step": int(step.item() if isinstance(step, torch.Tensor) else step),
            "state_keys": sorted({k for ks in keys.values() for k in ks}), "loss_scaler": {}}
    return meta, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, tensors.__getitem__


def _steps(source: Any) -> int:
    return int(source.read_json("runner")["optimizer_steps"]) if source.has("runner") else 0


# ---- writers: each fills a fresh staging directory and returns the names it wrote ------------------------------


def write_shardkit(source: Any, stage: Path, tick: Tick) -> list[str]:
    """A one-rank sharded shardkit checkpoint (model, optimizer, step, the user's values and stateful entries) that
    ``Runner.load`` resumes at any layout. Data loader positions are per rank and are not carried."""
    model = _named(source, "module", MODEL) or (MODEL if source.has(MODEL) else None)
    if model is None:
        raise CheckpointError(f"{source.path}: holds no model to convert")
    optim = _named(source, "optimizer", OPTIMIZER)
    inner = stage / "checkpoint"
    with CheckpointWriter(inner, update_latest=False, info={"strategy": "converted", "world_size": 1}) as w:
        specs = [(k, d, s) for k, (s, d) in source.sharded_keys(model).items()]
        w.write_shard_streamed(MODEL, specs, lambda k: tick(source.read_full(model, k)))
        if source.has(model_config_entry(model)):  # shardkit's Llama: its config, for a later --to hf
            w.write_json(model_config_entry(MODEL), source.read_json(model_config_entry(model)))
        kinds = {MODEL: "module"}
        if optim is not None:
            meta, keys, fetch = optimizer_parts(source, optim)
            w.write_shard_streamed(OPTIMIZER, [(k, d, s) for k, (s, d) in keys.items()], lambda k: tick(fetch(k)))
            w.write_state(f"{OPTIMIZER}.meta", meta)
            kinds[OPTIMIZER] = "optimizer"
        # the user's plain values and stateful objects (a scheduler) travel too: dropping them would resume a run
        # whose epoch or schedule silently starts over
        saved = source.read_json("entries") if source.has("entries") else {}
        for name, kind in saved.items():
            if kind == "stateful" and name not in kinds and source.has(name):
                w.write_state(name, source.read_state(name))
                kinds[name] = kind
        w.write_json("entries", kinds)
        w.write_state("values", source.read_state("values") if source.has("values") else {})
        w.write_json("precision", source.read_json("precision") if source.has("precision") else {})
        w.write_json("runner", {"micro_step": 0, "boundary": False, "optimizer_steps": _steps(source)})
    names = []
    for f in sorted(inner.iterdir()):
        os.replace(f, stage / f.name)
        names.append(f.name)
    inner.rmdir()
    names.remove(MANIFEST)
    return [*names, MANIFEST]  # the manifest last: a directory holding it is complete


def write_dcp(source: Any, stage: Path, tick: Tick, layout: str = "torch") -> list[str]:
    """The model and optimizer as ``dcp.save`` writes them, in ``layout`` ``torch`` (``get_state_dict``'s
    structure under ``model``/``optimizer``) or ``torchtitan`` (model FQNs at the top, the optimizer flattened),
    plus ``train_state.step``."""
    if layout not in ("torch", "torchtitan"):
        raise CheckpointError(f"DCP layout {layout!r}: choose 'torch' or 'torchtitan'")
    titan = layout == "torchtitan"
    model = _named(source, "module", MODEL) or MODEL
    optim = _named(source, "optimizer", OPTIMIZER)
    w = DCPStreamWriter(stage)
    try:
        for fqn in source.sharded_keys(model):
            w.tensor((fqn,) if titan else (MODEL, fqn), tick(source.read_full(model, fqn)))
        if optim is not None:
            meta, _, fetch = optimizer_parts(source, optim)
            for fqn, keys in meta["tensor_keys"].items():
                for k in keys:
                    path = (OPTIMIZER, f"state.{fqn}.{k}") if titan else (OPTIMIZER, "state", fqn, k)
                    w.tensor(path, tick(fetch(f"{fqn}{_SEP}{k}")))
                for k, v in meta["scalars"].get(fqn, {}).items():
                    path = (OPTIMIZER, f"state.{fqn}.{k}") if titan else (OPTIMIZER, "state", fqn, k)
                    w.tensor(path, v) if isinstance(v, torch.Tensor) else w.value(path, v)
            for i, group in enumerate(meta["param_groups"]):
                for h, v in group.items():
                    if titan and h != "params":
                        for fqn in group["params"]:
                            w.value((OPTIMIZER, f"param_groups.{fqn}.{h}"), v)
                    elif not titan:
                        w.value((OPTIMIZER, "param_groups", i, h), list(v) if h == "params" else v)
        w.value(("train_state", "step"), _steps(source))
    except BaseException:
        w.abort()
        raise
    return w.close()


def write_hf(source: Any, stage: Path, tick: Tick, *, dtype: torch.dtype | None = torch.float32,
             max_shard_size: int | str = "5GB") -> list[str]:
    """The model as ``zero-to-fp32`` writes it: safetensors (sharded past ``max_shard_size``; MoE experts one tensor
    per expert for a Qwen2-MoE/Qwen3-MoE/Mixtral config, :mod:`.expert_layout`) and the config and tokenizer files
    found beside the source."""
    model = _named(source, "module", MODEL) or MODEL
    copied = copy_model_files([Path(source.path), Path(source.path).parent], stage)
    llama = llama_export_of(source, model)
    if llama is not None:  # shardkit's Llama, as the transformers model it equals
        tied = source.aliases(model) if callable(getattr(source, "aliases", None)) else {}
        keys = {k: v for k, v in source.sharded_keys(model).items() if k not in tied}
        return write_llama(llama, stage, keys, lambda k: tick(source.read_full(model, k)), tied, copied,
                           dtype=dtype, max_shard_size=max_shard_size, original_format=True)
    keys, fetch = export_plan(source.sharded_keys(model), lambda k: tick(source.read_full(model, k)),
                              layout_for(model_type_of(stage)))
    names = write_hf_shards(stage, keys, fetch, dtype=dtype, max_shard_size=max_shard_size, tied={})
    return names + copied


def write_universal(shardkit_dir: Path, stage: Path, progress: Any) -> list[str]:
    """A DeepSpeed universal checkpoint from the shardkit checkpoint ``shardkit_dir`` (``ds_universal``'s writer)."""
    inner = stage / "universal"
    universal().shardkit_to_universal(shardkit_dir, inner, progress=progress, point_latest=False)  # moved below
    names = []
    for f in sorted(inner.iterdir()):
        os.replace(f, stage / f.name)
        names.append(f.name)
    shutil.rmtree(inner, ignore_errors=True)
    return names
