"""The ``shardkit`` command: ``commands`` holds the subcommand table and ``main``; each subcommand's module
registers its own arguments (shared parsers: ``shardkit.utils.parsing``). Importing this imports no torch."""

from shardkit.cli.commands import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
