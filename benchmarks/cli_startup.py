"""How long `shardkit --help` and `shardkit env --help` take, against the cost before issue 30 and `accelerate --help`.

    python benchmarks/cli_startup.py [--rounds 5]

"before" replays what the old entry point did on --help: `import shardkit` imported torch, the Runner and the
strategies, and every subcommand's module was imported to build the parser. The three commands alternate round
by round in fresh processes, so machine load affects them alike; medians are printed with the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_BEFORE = ("import shardkit.runner, shardkit.strategies.fsdp, shardkit.strategies.tensor_parallel, "
           "shardkit.distributed\nfrom shardkit import cli\ncli.build_parser().parse_args(['--help'])")
COMMANDS = {
    "shardkit --help (now)": [sys.executable, "-c", "from shardkit import cli; cli.main(['--help'])"],
    "shardkit env --help (now)": [sys.executable, "-c", "from shardkit import cli; cli.main(['env', '--help'])"],
    "shardkit --help (before)": [sys.executable, "-c", _BEFORE],
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
    now = medians["shardkit --help (now)"]
    for name, median in medians.items():
        rounds_text = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:<28} median {median:6.2f} s  ({median / now:5.1f}x now)  rounds: {rounds_text}")


if __name__ == "__main__":
    main()
