"""The process every JIT build runs under, so that no compile outlives the process that asked for it.

    python _build_supervisor.py PARENT_PID TIMEOUT_S COMMAND...

Started by :func:`shardkit.ops.build_lock.run_build_subprocess` (in its own session, with the build lock's file as
its stdin) it runs COMMAND and waits. It ends COMMAND's whole tree - python, ninja, every compiler - and exits when

- the process that started it is gone (killed by a job's timeout, SIGKILL, ...): checked every 0.1 s by its
  parent pid, which, unlike ``PR_SET_PDEATHSIG``, does not fire when merely the *thread* that started it exits;
- TIMEOUT_S has passed (exit code 124), or it receives SIGTERM/SIGINT/SIGHUP (exit code 143).

It makes itself the *child subreaper* (Linux), so a compiler whose ninja died is re-parented to it, not to init, and
is found and ended too. The lock travels as stdin, the one descriptor that ``subprocess`` (torch's and DeepSpeed's
call of ninja) hands on to every child: the build lock stays held while any of them lives, even if this process
itself is killed with SIGKILL, so a next build never runs beside a compile still writing into the same folder.

Run by path, it imports nothing but the standard library (no torch: it starts in milliseconds).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.1
_GRACE_S = 3.0  # SIGTERM first: ninja passes it to its compilers and gcc deletes its half-written output
EXIT_TIMEOUT = 124
EXIT_STOPPED = 143


def _become_subreaper() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _live_children() -> dict[int, list[int]]:
    """Parent pid -> pids of its live (not zombie) children, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def _descendants() -> list[int]:
    children, found, todo = _live_children(), [], [os.getpid()]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _reap() -> dict[int, int]:
    """Collect every exited child (this process is their subreaper): pid -> wait status."""
    reaped = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped[pid] = status


def end_tree() -> None:
    """End every descendant: SIGTERM, a grace period, then SIGKILL until none is left."""
    if not os.path.isdir("/proc"):  # no /proc to walk: the group this process leads is the tree it knows
        with contextlib.suppress(OSError):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.killpg(os.getpgrp(), signal.SIGTERM)
        return
    deadline = time.monotonic() + _GRACE_S
    sig = signal.SIGTERM
    while True:
        pids = _descendants()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.05)
        _reap()
        if time.monotonic() > deadline:
            sig = signal.SIGKILL


def main(argv: list[str]) -> int:
    parent, timeout_s, command = int(argv[0]), float(argv[1]), argv[2:]
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    _become_subreaper()
    if os.getppid() != parent:  # it died before this process could watch it
        return EXIT_STOPPED
    child = os.posix_spawn(command[0], command, os.environ)
    deadline = time.monotonic() + timeout_s
    code = None
    while code is None:
        reaped = _reap()
        if child in reaped:
            code = os.waitstatus_to_exitcode(reaped[child])
            break
        if stop or os.getppid() != parent:
            code = EXIT_STOPPED
        elif time.monotonic() > deadline:
            code = EXIT_TIMEOUT
        else:
            time.sleep(_POLL_S)
    end_tree()  # also after a normal exit: nothing the build started may outlive it
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
