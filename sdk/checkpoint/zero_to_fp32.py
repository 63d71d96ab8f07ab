"""``shardkit zero-to-fp32 CKPT OUT``: consolidate a shardkit or DeepSpeed checkpoint into safetensors.

Reads shardkit checkpoints (any strategy, any world size) and DeepSpeed ZeRO-1/2/3 checkpoints
(``global_stepN/`` with a ``latest`` file) with no process group, no config and no DeepSpeed; the
format is detected. Also ``python -m shardkit.checkpoint.zero_to_fp32``. From Python:
:func:`get_fp32_state_dict` (a lazy mapping) and :func:`load_state_dict_from_zero_checkpoint`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from shardkit.utils.lazy import lazy_exports

if TYPE_CHECKING:
    import torch

    from .consolidate import get_fp32_state_dict, load_state_dict_from_zero_checkpoint

__all__ = ["get_fp32_state_dict", "load_state_dict_from_zero_checkpoint", "main", "register"]

# NOTE: the Python API loads on first use and the tool imports it when it runs, so that `shardkit zero-to-fp32
# --help` does not import torch (5 s on a busy 2-core machine).
__getattr__, __dir__ = lazy_exports(__name__, {"get_fp32_state_dict": "consolidate",
                                               "load_state_dict_from_zero_checkpoint": "consolidate"})

# --dtype's choices; the torch dtype each names is `_dtype(name)`.
_DTYPE_NAMES = ("bf16", "fp16", "fp32", "keep")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory, or its parent holding `latest` (shardkit or DeepSpeed)")
    p.add_argument("output_dir", help="where model*.safetensors (and the index, config.json and tokenizer files "
                   "found beside the checkpoint) are written; a previous export there is replaced atomically")
    p.add_argument("--max-shard-size", "--max_shard_size", default="5GB",
                   help="largest output file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--dtype", choices=_DTYPE_NAMES, default="fp32",
                   help="dtype of floating tensors (default fp32; keep = as saved)")
    p.add_argument("--name", default="model", help="shardkit: the checkpoint entry to convert (default model)")
    p.add_argument("-t", "--tag", default=None,
                   help="the checkpoint under CHECKPOINT to convert (e.g. global_step14); default: `latest`")
    p.add_argument("--exclude-frozen-parameters", "--exclude_frozen_parameters", action="store_true",
                   help="DeepSpeed: leave out parameters that were not trained (requires_grad=False)")
    p.add_argument("--stacked-experts", action="store_true",
                   help="write MoE expert weights stacked (experts.gate_up_proj, experts.down_proj) as transformers 5 "
                   "holds them; default: for a Qwen2-MoE/Qwen3-MoE/Mixtral config.json beside the checkpoint, one "
                   "tensor per expert, as transformers' save_pretrained writes them")
    p.add_argument("--shardkit-names", action="store_true",
                   help="shardkit's Llama: write its own parameter names, as it holds them; default: the transformers "
                   "architecture it equals (Llama, Mixtral, Qwen2-MoE or GLM4-MoE) with its config.json")
    p.add_argument("--safe-serialization", "--safe_serialization", action="store_true",
                   help="accepted as DeepSpeed's script takes it: the output is always safetensors")


def _dtype(name: str) -> torch.dtype | None:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "keep": None}[name]


def _run(args: argparse.Namespace) -> int:
    from .consolidate import consolidate, consolidate_deepspeed
    from .deepspeed_reader import find_deepspeed_checkpoint
    from .export import MODEL_FILES, check_output_dir
    from .format import CheckpointError
    from .trust import check_child_dir

    try:
        ds = find_deepspeed_checkpoint(args.checkpoint, args.tag)
        if ds is not None or args.tag:
            check_output_dir(args.output_dir, [args.checkpoint])  # not inside what was named: a parent of tags too
        if ds is not None:
            paths = consolidate_deepspeed(ds, args.output_dir, dtype=_dtype(args.dtype),
                                          max_shard_size=args.max_shard_size,
                                          exclude_frozen_parameters=args.exclude_frozen_parameters,
                                          original_format=not args.stacked_experts)
        else:
            path = check_child_dir(Path(args.checkpoint), args.tag, "--tag") if args.tag else args.checkpoint
            paths = consolidate(path, args.output_dir, name=args.name, dtype=_dtype(args.dtype),
                                max_shard_size=args.max_shard_size, original_format=not args.stacked_experts,
                                as_transformers=not args.shardkit_names)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the checks above did not foresee (permissions, a vanished directory)
        print(f"error: {e.filename or args.output_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    out = paths[0].parent if paths else Path(args.output_dir)
    copied = [n for n in MODEL_FILES if (out / n).is_file()]
    if ds is None and not args.shardkit_names and _records_llama(path, args.name):
        print("shardkit's Llama: written as the transformers architecture it equals, with its config.json",
              file=sys.stderr)
    elif copied:
        print(f"with {', '.join(copied)} from beside the checkpoint", file=sys.stderr)
    if "config.json" not in copied:
        print(f"note: no config.json was found beside the checkpoint, so {out} holds the weights only and "
              f"from_pretrained({str(out)!r}) cannot build the model: copy the model's config.json there (or call "
              f"model.config.save_pretrained({str(out)!r})); load_state_dict on a model you build also works",
              file=sys.stderr)
    return 0


def _records_llama(path: str | Path, name: str) -> bool:
    from .llama_hf import model_config_entry
    from .reader import CheckpointReader

    with CheckpointReader(path, verify=False) as reader:
        return reader.has(model_config_entry(name))


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``zero-to-fp32`` subcommand; its ``func`` default takes the parsed args, returns the exit code."""
    p = subparsers.add_parser("zero-to-fp32", help="consolidate a checkpoint into full-precision safetensors",
                              description=__doc__.splitlines()[0])
    _add_arguments(p)
    p.set_defaults(func=_run)
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m shardkit.checkpoint.zero_to_fp32") -> int:
    """Runs the tool; returns the exit code (0 ok, 2 on a checkpoint error). ``prog`` names it in usage lines."""
    parser = argparse.ArgumentParser(prog=prog,
                                     description=__doc__.splitlines()[0])
    _add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
