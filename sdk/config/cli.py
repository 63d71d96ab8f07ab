"""`shardkit config`: write an Accelerate-style YAML by answering questions (or passing them all as flags).

    shardkit config                                   # asks, writes shardkit_config.yaml
    shardkit config --distributed-type FSDP --num-processes 2 --mixed-precision bf16 --yes -o fsdp.yaml
    shardkit launch --config_file fsdp.yaml train.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardkit.config.questions import QUESTIONS, answers_to_yaml_dict, ask

__all__ = ["DEFAULT_CONFIG_FILE", "register", "run"]

DEFAULT_CONFIG_FILE = "shardkit_config.yaml"  # = shardkit.distributed.cli.DEFAULT_CONFIG_FILE, what launch reads


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("y", "yes", "true", "1"):
        return True
    if lowered in ("n", "no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `shardkit config`."""
    parser = subparsers.add_parser(
        "config", help="write a launch config (Accelerate-style YAML) by answering questions",
        description="Ask the questions of an Accelerate-style config and write the YAML that `shardkit launch "
                    "--config_file` and Runner() read. Every answer can be given as a flag; with --yes (or when "
                    "input ends) the remaining questions take their defaults.")
    parser.add_argument("-o", "--config-file", "--config_file", dest="config_file", default=DEFAULT_CONFIG_FILE,
                        help=f"where to write the YAML (default: ./{DEFAULT_CONFIG_FILE})")
    parser.add_argument("-y", "--yes", action="store_true", help="ask nothing: defaults for every answer not given")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")
    for question in QUESTIONS:
        kind = _bool if question.kind is bool else question.kind
        choices = f" ({'/'.join(map(str, question.choices))})" if question.choices else ""
        parser.add_argument(question.flag, question.flag.replace("-", "_").replace("__", "--", 1), dest=question.key,
                            type=kind, default=None,
                            help=f"{question.prompt}{choices} [default: {question.default}]")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Ask, write and read back the config; the exit code is 0 on success, 2 on a bad answer set."""
    import yaml

    from shardkit.config.accelerate import load_accelerate_config
    from shardkit.config.common import ConfigError

    given = {q.key: getattr(args, q.key, None) for q in QUESTIONS}
    for question in QUESTIONS:
        if given[question.key] is not None and question.choices:
            try:
                given[question.key] = question.parse(str(given[question.key]))
            except ValueError as err:
                print(f"shardkit config: error: {err}", file=sys.stderr)
                return 2
    path = Path(args.config_file)
    if path.exists() and not args.force:
        print(f"shardkit config: error: {path} exists; pass --force to overwrite it", file=sys.stderr)
        return 2
    answers = ask(given, interactive=not args.yes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(answers_to_yaml_dict(answers), sort_keys=True))
    try:
        loaded = load_accelerate_config(path)
    except (ConfigError, NotImplementedError) as err:
        path.unlink()
        print(f"shardkit config: error: these answers do not make a usable config: {err}", file=sys.stderr)
        return 2
    what = loaded.strategy[0] if loaded.strategy else "ZeRO (DeepSpeed)"
    print(f"wrote {path}: {what}, mixed_precision {loaded.mixed_precision}, {loaded.num_processes} process(es) on "
          f"{loaded.num_machines} machine(s). Run: shardkit launch --config_file {path} train.py")
    return 0
