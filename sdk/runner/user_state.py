"""The user's state in a checkpoint: how ``Runner.save``/``load`` map a ``state`` dict of user objects
(models, optimizers, data loaders, stateful objects, plain values) onto checkpoint entries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardkit import checkpoint as ckpt
from shardkit.checkpoint import format as ckpt_format
from shardkit.checkpoint.llama_hf import model_config_entry
from shardkit.data.loader import RunnerDataLoader
from shardkit.strategies.base import Strategy

__all__ = ["StateSaver", "check_module_dtypes"]

_ENTRIES = ckpt_format.USER_KINDS_ENTRY
_VALUES = ckpt_format.USER_VALUES_ENTRY


def _kind(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, RunnerDataLoader):
        return "dataloader"
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "rank_stateful" if getattr(obj, "checkpoint_per_rank", False) is True else "stateful"
    return "value"


class StateSaver:
    """Saves and loads each entry of a Runner state dict through the strategy's hooks.

    Modules and optimizers go through the strategy (which knows whether they are sharded), data
    loader positions are written per rank, anything else with ``state_dict``/``load_state_dict``
    (schedulers) is stored as nested state, and plain values as JSON.

    An object with ``state_dict``/``load_state_dict`` and ``checkpoint_per_rank = True`` holds state that differs
    between ranks (an RL trainer's buffered generation round): every rank writes its own ``state_dict()`` as the
    entry ``rank_entry(key, rank)``, in the same atomic save as the rest (the checkpoint is published only with
    every rank's), and each rank loads its own; a checkpoint saved by fewer ranks has none for the others, which is
    a named error.
    """

    def __init__(self, strategy: Strategy, owner_of: Callable[[torch.optim.Optimizer], nn.Module]):
        self.strategy = strategy
        self.owner_of = owner_of

    def save(self, writer: ckpt.CheckpointWriter, state: dict[str, Any]) -> None:
        strategy, main = self.strategy, self.strategy.is_global_zero
        kinds = {key: _kind(obj) for key, obj in state.items()}
        values = {}
        for key, obj in state.items():
            kind = kinds[key]
            if kind == "module":
                strategy.save_module(writer, key, obj)
                if main:
                    _record_model_config(writer, key, strategy.unwrap(obj))
            elif kind == "optimizer":
                strategy.save_optimizer(writer, key, obj, self.owner_of(obj))
            elif kind == "dataloader":
                writer.write_json(ckpt.rank_entry(key, strategy.rank), obj.state_dict())
            elif kind == "stateful" and main:
                writer.write_state(key, obj.state_dict())
            elif kind == "rank_stateful":
                writer.write_state(ckpt.rank_entry(key, strategy.rank), obj.state_dict())
            elif kind == "value":
                values[key] = obj
        if main:
            writer.write_json(_ENTRIES, kinds)
            writer.write_state(_VALUES, values)

    def load(self, reader: ckpt.CheckpointReader, state: dict[str, Any]) -> dict[str, Any]:
        saved = reader.read_json(_ENTRIES, check=_check_entries)
        for key, obj in state.items():
            kind = _kind(obj)
            if key not in saved:
                raise ckpt.CheckpointError(
                    f"{reader.path} has no entry {key!r}; it holds {sorted(saved)}. "
                    "Load with the keys it was saved with"
                )
            if saved[key] != kind:
                raise ckpt.CheckpointError(
                    f"{reader.path}: entry {key!r} was saved as a {saved[key]} but is being loaded into a {kind}"
                )
        values = reader.read_state(_VALUES)
        for key, obj in state.items():
            kind = _kind(obj)
            if kind == "module":
                check_module_dtypes(reader, key, self.strategy.unwrap(obj))
                self.strategy.load_module(reader, key, obj)
            elif kind == "optimizer":
                self.strategy.load_optimizer(reader, key, obj, self.owner_of(obj))
            elif kind == "dataloader":
                obj.load_state_dict(reader.read_json(_rank_entry(reader, key, self.strategy.rank)))
            elif kind == "stateful":
                obj.load_state_dict(reader.read_state(key))
            elif kind == "rank_stateful":
                obj.load_state_dict(reader.read_state(_own_rank_entry(reader, key, self.strategy.rank)))
        return values


def _record_model_config(writer: ckpt.CheckpointWriter, key: str, module: nn.Module) -> None:
    """shardkit's Llama has no config file of its own: its config goes into the checkpoint, so that zero-to-fp32 and
    ``convert --to hf`` write the transformers model it equals (``checkpoint.llama_hf``) from the files alone."""
    config = getattr(module, "config", None)
    if callable(getattr(module, "hf_export", None)) and callable(getattr(config, "to_dict", None)):
        writer.write_json(model_config_entry(key), config.to_dict())


def check_module_dtypes(reader: ckpt.CheckpointReader, name: str, module: nn.Module) -> None:
    """Refuses to load entry ``name`` into ``module`` when a tensor's stored dtype would change on load,
    other than by a documented cast (fp32 <-> fp16/bf16 of floating tensors; :func:`shardkit.checkpoint.check_cast`),
    or when its shape is not the model's, before anything is copied.

    Raises:
        CheckpointError: naming the checkpoint, the key and both dtypes.
    """
    saved = reader.sharded_keys(name)
    for key, live in module.state_dict(keep_vars=True).items():
        if key in saved and isinstance(live, torch.Tensor):  # missing keys: the strategy's error, its own message
            ckpt.check_cast(saved[key][1], live.dtype, f"{reader.path}: {name}", key)
            # a partitioned parameter (ZeRO-3) shows no shape here; its strategy checks it against the saved one
            if live.numel() and tuple(live.shape) != tuple(saved[key][0]):
                raise ckpt.CheckpointError(
                    f"{reader.path}: {name}: {key!r} was saved with shape {list(saved[key][0])}, the model has "
                    f"{list(live.shape)}; the checkpoint belongs to another model (nothing was loaded)")


def _check_entries(saved: Any, file: Any) -> dict[str, str]:
    bad = (None if isinstance(saved, dict) else "(the whole file)") or next(
        (k for k, v in saved.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise ckpt.CheckpointError(f"{file}: field {bad[:200]!r} is not a kind name: the file must map each saved name "
                                   "to its kind (an object of strings); the checkpoint is corrupt or was edited")
    return saved


def _own_rank_entry(reader: ckpt.CheckpointReader, key: str, rank: int) -> str:
    name = ckpt.rank_entry(key, rank)
    if not reader.has(name):
        raise ckpt.CheckpointError(
            f"{reader.path}: entry {key!r} holds one state per rank and has none for rank {rank} (saved by "
            f"{reader.world_size} ranks): resume with the ranks it was saved with, or from another checkpoint")
    return name


def _rank_entry(reader: ckpt.CheckpointReader, key: str, rank: int) -> str:
    name = ckpt.rank_entry(key, rank)
    if reader.has(name):
        return name
    # Saved with fewer ranks: every rank of a data-parallel run walks the same position.
    return ckpt.rank_entry(key, 0)
