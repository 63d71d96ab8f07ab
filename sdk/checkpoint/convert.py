"""``shardkit convert SRC DST --to {shardkit,dcp,hf,ds-universal}``: one checkpoint format into another.

The source format is detected (:func:`shardkit.checkpoint.formats.detect_format`). Tensors stream one at a
time from the source into the output's one data file, so memory stays near the largest tensor plus the
writer's buffer; a DCP source is read chunk by chunk. The output is written into a hidden staging directory
beside DST and renamed into place only once every file is whole and fsynced (:mod:`.export`): a failed or
killed conversion leaves no DST that looks complete. A progress bar goes to stderr when it is a terminal.
``shardkit zero-to-fp32`` remains the name for ``--to hf`` from shardkit or DeepSpeed ZeRO checkpoints.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import torch

__all__ = ["Progress", "convert", "main", "register"]

_TARGETS = ("shardkit", "dcp", "hf", "ds-universal")


class Progress:
    """Bytes converted so far, redrawn on one line of ``stream`` at most every 0.2 s; silent when ``stream`` is
    not a terminal (a log file gets no carriage returns). ``update(n)`` as tqdm's; :meth:`tick` counts a tensor."""

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label, self.done, self.tensors, self._shown = label, 0, 0, 0.0
        self._start = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._shown > 0.2:
            self._shown = now
            rate = self.done / max(now - self._start, 1e-9)
            self.stream.write(f"\r{self.label}: {self.tensors} tensors, {_human(self.done)} ({_human(rate)}/s)  ")
            self.stream.flush()

    def tick(self, t: torch.Tensor) -> torch.Tensor:
        self.tensors += 1
        self.update(t.numel() * t.element_size())
        return t

    def close(self) -> None:
        if self.enabled:
            self.stream.write(f"\r{self.label}: {self.tensors} tensors, {_human(self.done)}, done\n")
            self.stream.flush()


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, layout: str = "torch",
            dtype: torch.dtype | str | None = None, max_shard_size: int | str = "5GB",
            progress: Progress | None = None) -> list[Path]:
    """Converts the checkpoint at ``src`` into format ``to`` at ``dst`` (see the module docstring).

    Args:
        layout: for ``--to dcp``: ``torch`` (``get_state_dict``'s structure under ``model``/``optimizer``) or
            ``torchtitan`` (model FQNs at the top, the optimizer flattened).
        dtype: for ``--to hf``: floating tensors cast to it (None: fp32), or ``"keep"`` to keep the source's.
        max_shard_size: for ``--to hf``: the largest output file.

    Returns:
        The paths published in ``dst``.

    Raises:
        CheckpointError: an unknown target, a source that cannot go there, or a bad source (naming the file).
    """
    import torch  # deferred: start-up time (torch)

    from shardkit.utils.suggest import did_you_mean

    from . import formats
    from .consolidate import consolidate_deepspeed
    from .export import check_output_dir, publish_export
    from .format import CheckpointError
    from .reader import resolve_checkpoint

    if to not in _TARGETS:
        raise CheckpointError(f"--to {to!r}: not a format shardkit writes{did_you_mean(to, _TARGETS)}; "
                              f"choose one of {', '.join(_TARGETS)}")
    # an option the target does not take would be ignored: the output would not be what was asked
    if dtype is not None and to != "hf":
        raise CheckpointError(f"--dtype applies to --to hf only; a {to} checkpoint keeps the source's dtypes "
                              "(drop --dtype)")
    if layout != "torch" and to != "dcp":
        raise CheckpointError(f"--layout applies to --to dcp only (drop --layout {layout})")
    if dtype is not None and dtype != "keep" and not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"dtype {dtype!r}: pass a torch dtype or 'keep'")
    src, dst = Path(src), Path(dst)
    fmt = formats.detect_format(src)
    hf_dtype = torch.float32 if dtype is None else None if dtype == "keep" else dtype
    if fmt == "hf":
        raise CheckpointError(f"{src}: is a Hugging Face model directory; load it with from_pretrained (or "
                              "shardkit.checkpoint.hf.load_pretrained under a strategy), then save with shardkit")
    if fmt == "deepspeed":
        if to != "hf":
            raise CheckpointError(f"{src}: is a DeepSpeed ZeRO checkpoint, which converts only --to hf here; for "
                                  f"--to {to}, first run DeepSpeed's ds_to_universal on it and convert its output")
        return consolidate_deepspeed(src, dst, dtype=hf_dtype, max_shard_size=max_shard_size)
    bar = progress or Progress(f"{fmt} -> {to}")
    sources = [src]
    check_output_dir(dst, sources)  # before any work: a universal source is converted once before publishing
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.convert-") as scratch:
            if fmt == "ds-universal":  # through shardkit's format, written by the universal module
                shardkit_dir = Path(scratch) / "shardkit"
                formats.universal().universal_to_shardkit(src, shardkit_dir, progress=bar)
                src, fmt = shardkit_dir, "shardkit"
            if to == "ds-universal":
                if fmt != "shardkit":
                    staged = Path(scratch) / "shardkit-staged"
                    with formats.open_checkpoint(src) as source:
                        publish_export(staged, lambda s: formats.write_shardkit(source, s, bar.tick), sources)
                    src = staged
                base = resolve_checkpoint(src)
                written = publish_export(dst, lambda s: formats.write_universal(base, s, bar), [*sources, base])
                # as ds_to_universal leaves it: the parent's latest_universal names the new tag (written whole)
                pointer = dst.parent / "latest_universal"
                partial = dst.parent / f".latest_universal.{os.getpid()}"
                partial.write_text(dst.name)
                os.replace(partial, pointer)
                return written
            with formats.open_checkpoint(src) as source:
                def write(stage: Path) -> list[str]:
                    if to == "dcp":
                        return formats.write_dcp(source, stage, bar.tick, layout=layout)
                    if to == "hf":
                        return formats.write_hf(source, stage, bar.tick, dtype=hf_dtype, max_shard_size=max_shard_size)
                    return formats.write_shardkit(source, stage, bar.tick)

                return publish_export(dst, write, [*sources, source.path])
    finally:
        if progress is None:
            bar.close()


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the checkpoint to read: shardkit, torch.distributed.checkpoint (DCP), DeepSpeed "
                   "universal, or (for --to hf) DeepSpeed ZeRO; the format is detected")
    p.add_argument("dst", help="the directory to write; published only when complete")
    p.add_argument("--to", required=True, choices=_TARGETS, help="the output format")
    p.add_argument("--layout", choices=("torch", "torchtitan"), default=None,
                   help="--to dcp: torch's get_state_dict structure under model/optimizer (default), or "
                   "torchtitan's (model FQNs at the top, the optimizer flattened)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "keep"), default=None,
                   help="--to hf: dtype of floating tensors (default fp32; keep: the source's)")
    p.add_argument("--max-shard-size", default="5GB", help="--to hf: largest output file (default 5GB)")


def _run(args: argparse.Namespace) -> int:
    import torch  # deferred: start-up time (torch)

    from .format import CheckpointError

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "keep": "keep",
             None: None}[args.dtype]
    try:
        paths = convert(args.src, args.dst, args.to, layout=args.layout or "torch", dtype=dtype,
                        max_shard_size=args.max_shard_size)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or args.dst}: {e.strerror or e}", file=sys.stderr)
        return 2
    out = paths[0].parent if paths else Path(args.dst)
    print(out)
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``convert`` subcommand; its ``func`` default takes the parsed args, returns the exit code."""
    p = subparsers.add_parser("convert", help="convert a checkpoint between shardkit, DCP, HF and DeepSpeed "
                              "universal", description=__doc__.splitlines()[0])
    _add_arguments(p)
    p.set_defaults(func=_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardkit.checkpoint.convert``; returns the exit code (0 ok, 2 on a checkpoint error)."""
    parser = argparse.ArgumentParser(prog="python -m shardkit.checkpoint.convert", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
