"""How long `shardkit [COMMAND] --help` takes, against the cost before issue 30 and `accelerate --help`.

    python benchmarks/cli_startup.py [--rounds 5]

"before" replays what the old entry point did on --help: `import shardkit` imported torch, the Runner and the
strategies, and every subcommand's module was imported to build the parser; for a subcommand, what its package's
eager `__init__` and its module's top-level imports loaded. The commands alternate round by round in fresh
processes, so machine load affects them alike; medians are printed with a ratio: a "before" to its own "now",
the others to `shardkit --help` (now).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_BEFORE = ("import shardkit.runner.core, shardkit.strategies.fsdp, shardkit.strategies.tensor_parallel, "
           "shardkit.distributed\nfrom shardkit import cli\ncli.build_parser().parse_args(['--help'])")
# What each subcommand's --help imported before issue 30's lazy package __init__s.
_SUBCOMMAND_BEFORE = {
    "launch": "shardkit.distributed.launcher, shardkit.distributed.supervise",
    "estimate-memory": "shardkit.precision.bf16, shardkit.precision.fp8, shardkit.strategies.ddp, "
                       "shardkit.strategies.fsdp, shardkit.strategies.single, shardkit.memory.estimate",
    "zero-to-fp32": "shardkit.checkpoint.consolidate, shardkit.checkpoint.reader, shardkit.checkpoint.writer, "
                    "shardkit.checkpoint.export, shardkit.checkpoint.deepspeed_reader",
}


def _help(argv: list[str], imports: str = "") -> list[str]:
    before = f"import {imports}\n" if imports else ""
    return [sys.executable, "-c", f"{before}from shardkit import cli\ntry: cli.main({argv!r})\nexcept SystemExit: pass"]


COMMANDS = {
    "shardkit --help (now)": _help(["--help"]),
    "shardkit env --help (now)": _help(["env", "--help"]),
    "shardkit --help (before)": [sys.executable, "-c", _BEFORE],
    **{f"shardkit {name} --help ({when})": _help([name, "--help"], imports if when == "before" else "")
       for name, imports in _SUBCOMMAND_BEFORE.items() for when in ("now", "before")},
    "accelerate --help": [sys.executable, "-m", "accelerate.commands.accelerate_cli", "--help"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, command in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        # A "before" against its own "now"; the rest against `shardkit --help`.
        now = medians.get(name.replace("(before)", "(now)"), medians["shardkit --help (now)"])
        rounds_text = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:<40} median {median:6.2f} s  ({median / now:5.1f}x)  rounds: {rounds_text}")


if __name__ == "__main__":
    main()
