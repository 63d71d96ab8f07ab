"""shardkit's checkpoint format: safetensors plus JSON, atomic saves, no pickle, zero-to-fp32.

A checkpoint is a directory (``runs/ckpt/step-000100``) whose parent holds a ``latest`` pointer::

    with CheckpointWriter(path, rank=r, world_size=n, barrier=dist.barrier, keep_last=3) as w:
        w.write_tensors("model", model.state_dict())
        w.write_state("optimizer", optimizer_state_by_name(opt, model))
    r = CheckpointReader("runs/ckpt")          # follows `latest`
"""

from .consolidate import (
    consolidate,
    consolidate_deepspeed,
    get_fp32_state_dict,
    load_state_dict_from_zero_checkpoint,
    parse_size,
)
from .format import FORMAT_NAME, FORMAT_VERSION, CheckpointError, rank_entry
from .optimizer import load_optimizer_state_by_name, optimizer_state_by_name
from .reader import CheckpointReader, resolve_checkpoint
from .rng import capture_rng_state, restore_rng_state
from .schema import check_precision_state, check_runner_state
from .trust import check_cast
from .writer import CheckpointBusyError, CheckpointWriter, ShardPiece, prune_checkpoints, recover_checkpoints

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointBusyError",
    "CheckpointError",
    "CheckpointReader",
    "CheckpointWriter",
    "ShardPiece",
    "capture_rng_state",
    "check_cast",
    "check_precision_state",
    "check_runner_state",
    "consolidate",
    "consolidate_deepspeed",
    "get_fp32_state_dict",
    "load_optimizer_state_by_name",
    "load_state_dict_from_zero_checkpoint",
    "optimizer_state_by_name",
    "parse_size",
    "prune_checkpoints",
    "rank_entry",
    "recover_checkpoints",
    "resolve_checkpoint",
    "restore_rng_state",
]
