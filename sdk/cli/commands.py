"""The `shardkit` command.

To add a subcommand, write a module with `register(subparsers)` that calls
`subparsers.add_parser(NAME, help=...)`, adds its arguments and sets
`parser.set_defaults(func=run)` where `run(args) -> int` returns the exit code; then add
`(NAME, "module.path", "one-line help")` to `COMMANDS`. A module that fails to import (an optional
package is missing) still shows in `shardkit --help` and fails with the reason only when used.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Sequence

__all__ = ["COMMANDS", "build_parser", "main"]

# (subcommand, module exposing register(subparsers), help shown if that module cannot be imported)
COMMANDS: list[tuple[str, str, str]] = [
    ("launch", "shardkit.distributed.cli", "run a script on N processes and M machines (torchrun)"),
    ("env", "shardkit.cli.env_info", "print versions and devices for a bug report"),
    ("config", "shardkit.config.cli", "write a launch config (Accelerate-style YAML) by answering questions"),
    ("zero-to-fp32", "shardkit.checkpoint.zero_to_fp32", "consolidate a checkpoint into fp32 safetensors"),
    ("convert", "shardkit.checkpoint.convert", "convert a checkpoint: shardkit, DCP, HF, DeepSpeed universal"),
    ("estimate-memory", "shardkit.memory.cli", "per-device memory of each strategy for a model; what fits"),
    ("build-ops", "shardkit.cli.build_ops", "build the C++ ops ahead (--deepspeed: and DeepSpeed's, for ZeRO)"),
]


def _unavailable(name: str, module: str, help_text: str, error: ImportError,
                 subparsers: argparse._SubParsersAction) -> None:
    missing = getattr(error, "name", None) or str(error)
    parser = subparsers.add_parser(name, help=f"{help_text} [unavailable: {missing} missing]", add_help=False)

    def run(_: argparse.Namespace) -> int:
        print(f"shardkit {name}: cannot import {module}: {error}. Install the missing package "
              f"({missing!r}) to use this command.", file=sys.stderr)
        return 2

    parser.set_defaults(func=run, accepts_any_arguments=True)


def _chosen(argv: Sequence[str] | None) -> str | None:
    """The subcommand named on the command line (the first argument that is one), if any."""
    names = {name for name, _, _ in COMMANDS}
    return next((arg for arg in argv or () if arg in names), None)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of `COMMANDS` registered.

    With ``argv``, only the subcommand it names is imported (the others are listed by their help line), so
    that ``shardkit --help`` and ``shardkit env`` do not import what other subcommands need.
    """
    parser = argparse.ArgumentParser(prog="shardkit", description="shardkit: train PyTorch models on one "
                                                                  "device or many.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen(argv) if argv is not None else None
    for name, module, help_text in COMMANDS:
        if argv is not None and name != chosen:
            # NOTE: only the top package is looked up: find_spec of a submodule imports its parents (torch).
            missing = importlib.util.find_spec(module.split(".")[0]) is None
            subparsers.add_parser(name, help=f"{help_text} [unavailable: {module} missing]" if missing else help_text,
                                  add_help=False)
            continue
        try:
            register = importlib.import_module(module).register
        except ImportError as err:
            _unavailable(name, module, help_text, err, subparsers)
            continue
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardkit` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.version:
        from importlib import metadata

        print(f"shardkit {metadata.version('shardkit')}")
        return 0
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2 if args.command is None else 1
    return int(args.func(args) or 0)
