"""shardkit's checkpoint format: safetensors plus JSON, atomic saves, no pickle, zero-to-fp32.

A checkpoint is a directory (``runs/ckpt/step-000100``) whose parent holds a ``latest`` pointer::

    with CheckpointWriter(path, rank=r, world_size=n, barrier=dist.barrier, keep_last=3) as w:
        w.write_tensors("model", model.state_dict())
        w.write_state("optimizer", optimizer_state_by_name(opt, model))
    r = CheckpointReader("runs/ckpt")          # follows `latest`
"""

from shardkit.utils.lazy import lazy_exports

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
    "newest_complete_checkpoint",
    "open_checkpoint",
    "optimizer_state_by_name",
    "parse_size",
    "prune_checkpoints",
    "rank_entry",
    "recover_checkpoints",
    "resolve_checkpoint",
    "restore_rng_state",
]

# NOTE: each name imports its module on first use, so that `shardkit <command> --help` does not import torch
# (see shardkit.utils.lazy).
_EXPORTS = {
    "consolidate": "consolidate", "consolidate_deepspeed": "consolidate", "get_fp32_state_dict": "consolidate",
    "load_state_dict_from_zero_checkpoint": "consolidate", "parse_size": "consolidate",
    "newest_complete_checkpoint": "discovery",
    "open_checkpoint": "formats",
    "FORMAT_NAME": "format", "FORMAT_VERSION": "format", "CheckpointError": "format", "rank_entry": "format",
    "load_optimizer_state_by_name": "optimizer", "optimizer_state_by_name": "optimizer",
    "CheckpointReader": "reader", "resolve_checkpoint": "reader",
    "capture_rng_state": "rng", "restore_rng_state": "rng",
    "check_precision_state": "schema", "check_runner_state": "schema",
    "check_cast": "trust",
    "CheckpointBusyError": "writer", "CheckpointWriter": "writer", "ShardPiece": "writer", "prune_checkpoints":
    "writer", "recover_checkpoints": "writer",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
