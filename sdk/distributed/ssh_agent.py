"""One host's part of ``shardkit launch --hostfile``: ``shardkit launch`` for this machine, bound to its ssh session.

    python -m shardkit.distributed.ssh_agent --num-processes 2 --num-machines 2 --machine-rank 1 ... train.py

What `shardkit.distributed.ssh_launch` runs on every host. Its arguments are ``shardkit launch``'s (the YAML's
hostfile keys are not followed again here). Standard input is the ssh session: when it ends (the launcher stopped
this host, or was itself killed, or the network went down) this process gets SIGTERM, which ``shardkit launch``
passes to its ranks with ``--stop-grace`` seconds to save before it kills their process groups. ssh without a
terminal sends a remote command no signal when the session ends, so without this the ranks would run on, orphaned.
Not for use by hand: with standard input closed or at end of file it stops at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

from shardkit.distributed.cli import register

__all__ = ["main"]


def _stop_when_session_ends() -> None:
    # NOTE: os.read on the descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader holds its
    # lock, and the interpreter then aborts at exit ("could not acquire lock for <stdin>").
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardkit", allow_abbrev=False)
    register(parser.add_subparsers())
    args = parser.parse_args(["launch", *(sys.argv[1:] if argv is None else argv)])
    args.on_host = True
    threading.Thread(target=_stop_when_session_ends, name="shardkit-ssh-session", daemon=True).start()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
