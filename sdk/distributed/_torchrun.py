"""torchrun as ``shardkit launch`` runs it: ``torch.distributed.run``, with a failed rank reported in a few lines.

torchrun ends a job whose rank failed with its own ChildFailedError traceback and a failure table (~40 lines,
after the rank's traceback, so the user scrolls past torch internals to find the cause). Here the same failure
is one short summary: which ranks failed, how (exit code or signal), and that each one's traceback is above.

    python -m shardkit.distributed._torchrun --nproc-per-node=2 ... train.py --lr 1e-3   # what `shardkit launch` runs

Every torchrun flag is written ``--name=value`` (or ``-m``), so the first argument without a leading dash is the
script, and everything after it is the script's: torchrun's own parser never sees those (it would read ``--num`` as
an ambiguous abbreviation of ``--numa-binding`` and end the launch).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["failure_summary", "main", "parse", "split_at_script"]


def failure_summary(script: str, failures: dict) -> str:
    """The lines printed for torchrun's ``ChildFailedError.failures`` (global rank -> ProcessFailure)."""
    lines = [f"shardkit launch: {len(failures)} rank(s) of {script} failed; the others were stopped"]
    for rank, failure in sorted(failures.items()):
        if failure.exitcode is not None and failure.exitcode < 0:
            how = f"was killed by {failure.signal_name()}"
            if failure.exitcode == -signal.SIGKILL:
                how += " (the system's out-of-memory killer sends SIGKILL; see below)"
            elif failure.exitcode == -signal.SIGTERM:
                how += " (the launcher stops the other ranks when one fails)"
        else:
            how = f"exited with code {failure.exitcode}; its traceback, if any, is printed above"
        lines.append(f"  rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}")
    return "\n".join(lines)


def _leave_exit_signals(failures: dict) -> None:
    """Under `shardkit launch`: the signals that ended ranks, for its out-of-memory diagnosis."""
    import os

    from shardkit.distributed.oom import write_exit_signals
    from shardkit.distributed.watchdog import REPORT_DIR_ENV

    folder = os.environ.get(REPORT_DIR_ENV)
    signals = {rank: -f.exitcode for rank, f in failures.items() if f.exitcode is not None and f.exitcode < 0}
    if folder and signals:
        write_exit_signals(folder, signals)


def split_at_script(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(torchrun's flags and the script, the script's arguments); flags are ``--name=value`` or ``-m``."""
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    return list(argv[:at + 1]), list(argv[at + 1:])


def parse(argv: Sequence[str]) -> Any:
    """torchrun's namespace for ``argv``: its parser reads the flags and the script, never the script's arguments."""
    from torch.distributed.run import parse_args

    head, script_args = split_at_script(argv)
    args = parse_args(head)
    args.training_script_args = script_args
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns 0, or 1 when a rank failed (torchrun's own exit code)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as err:
        print(failure_summary(err.name, err.failures), file=sys.stderr, flush=True)
        _leave_exit_signals(err.failures)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
