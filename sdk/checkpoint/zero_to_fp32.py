"""``shardkit zero-to-fp32 CKPT OUT``: consolidate a shardkit or DeepSpeed checkpoint into safetensors.

Reads shardkit checkpoints (any strategy, any world size) and DeepSpeed ZeRO-1/2/3 checkpoints
(``global_stepN/`` with a ``latest`` file) with no process group, no config and no DeepSpeed; the
format is detected. Also ``python -m shardkit.checkpoint.zero_to_fp32``. From Python:
:func:`get_fp32_state_dict` (a lazy mapping) and :func:`load_state_dict_from_zero_checkpoint`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from .consolidate import consolidate, consolidate_deepspeed
from .deepspeed_reader import DeepSpeedCheckpoint, ZeroFp32StateDict, find_deepspeed_checkpoint
from .format import CheckpointError
from .reader import CheckpointReader

__all__ = ["get_fp32_state_dict", "load_state_dict_from_zero_checkpoint", "main", "register"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "keep": None}


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
    return _ShardkitFp32StateDict(Path(checkpoint_dir) / tag if tag else Path(checkpoint_dir))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None, strict: bool = False) -> torch.nn.Module:
    """Copies a checkpoint's fp32 weights into ``model`` one tensor at a time; returns ``model``.

    Unlike DeepSpeed's function of the same name the model stays on its device and the full state
    dict is never built. Keys the model lacks, or that the checkpoint lacks, are an error only with
    ``strict=True`` (DeepSpeed loads with ``strict=False``).
    """
    sd = get_fp32_state_dict(checkpoint_dir, tag)
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if strict and (missing or unexpected):
        raise CheckpointError(f"{checkpoint_dir}: does not match the model: missing {missing[:10]}, "
                              f"unexpected {unexpected[:10]}; pass strict=False to load what matches")
    with torch.no_grad():
        for k, target in own.items():
            if k not in sd:
                continue
            value = sd[k]
            if value.shape != target.shape:
                raise CheckpointError(f"{checkpoint_dir}: {k} has shape {list(value.shape)} in the checkpoint, "
                                      f"{list(target.shape)} in the model")
            target.copy_(value)
    return model


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory, or its parent holding `latest` (shardkit or DeepSpeed)")
    p.add_argument("output_dir", help="where model*.safetensors (and the index) are written")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                   help="dtype of floating tensors (default fp32; keep = as saved)")
    p.add_argument("--name", default="model", help="shardkit: the checkpoint entry to convert (default model)")
    p.add_argument("-t", "--tag", default=None,
                   help="the checkpoint under CHECKPOINT to convert (e.g. global_step14); default: `latest`")
    p.add_argument("--exclude-frozen-parameters", action="store_true",
                   help="DeepSpeed: leave out parameters that were not trained (requires_grad=False)")


def _run(args: argparse.Namespace) -> int:
    try:
        ds = find_deepspeed_checkpoint(args.checkpoint, args.tag)
        if ds is not None:
            paths = consolidate_deepspeed(ds, args.output_dir, dtype=_DTYPES[args.dtype],
                                          max_shard_size=args.max_shard_size,
                                          exclude_frozen_parameters=args.exclude_frozen_parameters)
        else:
            path = Path(args.checkpoint) / args.tag if args.tag else args.checkpoint
            paths = consolidate(path, args.output_dir, name=args.name, dtype=_DTYPES[args.dtype],
                                max_shard_size=args.max_shard_size)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``zero-to-fp32`` subcommand; its ``func`` default takes the parsed args, returns the exit code."""
    p = subparsers.add_parser("zero-to-fp32", help="consolidate a checkpoint into full-precision safetensors",
                              description=__doc__.splitlines()[0])
    _add_arguments(p)
    p.set_defaults(func=_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the tool; returns the exit code (0 ok, 2 on a checkpoint error)."""
    parser = argparse.ArgumentParser(prog="python -m shardkit.checkpoint.zero_to_fp32",
                                     description=__doc__.splitlines()[0])
    _add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
