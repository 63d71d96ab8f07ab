"""``shardkit launch --max-restarts N``: restart a failed job, and stop one that fails the same way without progress.

Each attempt is a whole torchrun job under the launcher's supervisor (every rule of a plain launch holds per
attempt: a hung rank is named, nothing outlives it). When it fails, the launcher starts the whole group again, at
most N times, and tells it that it is a restart (``SHARDKIT_RESTART_COUNT``, see
:mod:`shardkit.distributed.restart_records`), so that the Runner's ``resume(..., mode="auto")`` and the Trainer load
the newest complete checkpoint by themselves. The whole group restarts, not torchrun's agent in place: a fresh
process group on CPU/gloo every time, and the launcher sees each attempt end, so that it can compare failures and
progress between them.

A job stops without a restart when its attempt failed the same way as the one before (the same error lines, or the
same signal, on the ranks that caused it) and made no progress: no optimizer step beyond what earlier attempts
reached and no new checkpoint. The reason is printed and the exit code is the attempt's.

With ``--num-machines`` > 1 every machine's launcher restarts its own ranks (all machines take the same flag): a
rank lost on one machine fails the collectives of the others, so every machine's attempt ends and restarts, and the
attempts meet again at the same rendezvous.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from shardkit.distributed.restart_records import (
    DETECTED_AT_ENV,
    FAILED_AT_ENV,
    LAST_STEP_ENV,
    RESTART_COUNT_ENV,
    RESTART_DIR_ENV,
    read_errors,
    read_progress,
    read_recovery,
    write_error,
)

__all__ = ["Attempt", "Restarts", "add_restart_flags", "check_restart_flags", "describe_attempt",
           "launch_with_restarts", "run_with_restarts", "should_stop"]


def add_restart_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-restarts`` (``accelerate launch``'s ``--max_restarts`` too)."""
    parser.add_argument("--max-restarts", "--max_restarts", type=int, dest="max_restarts", default=0,
                        help="restart a failed job up to this many times (default 0); each restart is told so and "
                             "resumes from the newest complete checkpoint (Runner.resume, the Trainer). A job that "
                             "fails the same way twice in a row without progress stops with its error")


def check_restart_flags(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag when ``--max-restarts`` is not a whole number >= 0."""
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts({args.max_restarts}) must be >= 0")


@dataclass
class Attempt:
    """One attempt that failed: how, and how far it got.

    Attributes:
        code: the attempt's exit code.
        causes: what ended it, one line per cause ("RuntimeError: boom (ranks [0, 1])", "rank 1 killed by SIGKILL").
        signature: ``causes`` without the ranks: two attempts that fail the same way have the same signature.
        failed_at / ended_at: Unix times its first rank died and the launcher had its end.
        step: the highest optimizer step it reached (None: not known); resumed / saved: the step it resumed from,
            the newest step it published a checkpoint of.
        progressed: it reached a step no earlier attempt had, or published a checkpoint beyond its resume point.
    """

    code: int
    causes: list[str]
    signature: tuple[str, ...]
    failed_at: float
    ended_at: float
    step: int | None
    resumed: int | None
    saved: int | None
    progressed: bool


def should_stop(history: Sequence[Attempt]) -> bool:
    """True when the last attempt failed as the one before it did and made no progress."""
    return len(history) >= 2 and history[-1].signature == history[-2].signature and not history[-1].progressed


def _is_consequence(line: str) -> bool:
    # A rank whose collective lost its peer did not cause the failure: the peer did (the launcher orders them so too).
    return "by peer" in line or "Broken pipe" in line


def describe_attempt(folder: str, attempt: int, code: int, outcome: object, ended_at: float,
                     best_step: int | None) -> Attempt:
    """The failed attempt ``attempt`` from the job's records and what the supervisor saw (``outcome``)."""
    errors = read_errors(folder, attempt)
    by_line: dict[str, list[int]] = {}
    for rank, (line, _) in sorted(errors.items()):
        by_line.setdefault(line, []).append(rank)
    causes = [(line, ranks) for line, ranks in by_line.items() if not _is_consequence(line)]
    signals = getattr(outcome, "signals", {})
    hung = list(getattr(outcome, "hung", []))
    # SIGTERM is how torchrun and the supervisor stop the ranks left after the first failure.
    killed = {rank: sig for rank, sig in signals.items() if rank not in errors and sig != signal.SIGTERM}
    lines = [f"{line} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" for line, ranks in causes]
    signature = [line for line, _ in causes]
    for rank, sig in sorted(killed.items()):
        lines.append(f"rank {rank} killed by {signal.Signals(sig).name}")
        signature.append(f"killed by {signal.Signals(sig).name}")
    if hung:
        lines.append(f"rank(s) {hung} hung")
        signature.append("hung")
    if not lines:  # only consequences, or nothing the job recorded: the exit status is all there is
        lines = [f"{line} (ranks {', '.join(map(str, ranks))})" for line, ranks in by_line.items()] or \
                [f"the job exited with code {code} (no rank left a Python error; see the output above)"]
        # a lost peer's message names ports that change every attempt: the failure is the same all the same
        signature = ["a peer closed its connection"] if by_line else [f"exit code {code}"]
    times = [t for _, t in errors.values()] + [getattr(outcome, "first_exit", None) or ended_at]
    progress = read_progress(folder, attempt)
    step, resumed, saved = progress["step"], progress["resumed"], progress["saved"]
    progressed = (step is not None and (best_step is None or step > best_step)) or \
        (saved is not None and (resumed is None or saved > resumed))
    return Attempt(code, lines, tuple(sorted(set(signature))), min(times), ended_at, step, resumed, saved,
                   progressed)


class Restarts:
    """The restart loop's state, shared by both launchers: the records folder, the failed attempts, the decisions.

    ``variables(attempt)`` are the environment variables of an attempt; ``failed(...)`` records a failed attempt and
    says whether to start another (printing why, or why not); ``close()`` prints the time lost and removes the folder.
    """

    def __init__(self, max_restarts: int, who: str = "shardkit launch"):
        self.max_restarts = max_restarts
        self.who = who
        self.folder = tempfile.mkdtemp(prefix="shardkit-restarts-")
        self.history: list[Attempt] = []
        self.succeeded = False

    def _best(self) -> int | None:
        return max((a.step for a in self.history if a.step is not None), default=None)

    def variables(self, attempt: int) -> dict[str, str]:
        variables = {RESTART_DIR_ENV: self.folder, RESTART_COUNT_ENV: str(attempt)}
        if self.history:
            best = self._best()
            variables.update({FAILED_AT_ENV: repr(self.history[-1].failed_at),
                              DETECTED_AT_ENV: repr(self.history[-1].ended_at),
                              LAST_STEP_ENV: "" if best is None else str(best)})
        return variables

    def failed(self, attempt: int, code: int, outcome: object, ended: float) -> bool:
        """Record the failed ``attempt``; True when another one should start."""
        before = self._best()
        self.history.append(describe_attempt(self.folder, attempt, code, outcome, ended, before))
        failed = self.history[-1]
        reason = "; ".join(failed.causes)
        if should_stop(self.history):
            where = f"no step beyond step {before}" if before is not None else "no optimizer step"
            self.say(f"stopping: attempt {attempt + 1} failed the same way as attempt {attempt} and made no progress "
                     f"({where}, no new checkpoint): {reason}. Restarting again would loop; fix the "
                     f"cause and launch again (the checkpoints are kept)")
            return False
        if attempt >= self.max_restarts:
            self.say(f"giving up: attempt {attempt + 1} failed and the {self.max_restarts} restart(s) of "
                     f"max_restarts are used up: {reason}")
            return False
        at = f" at step {failed.step}" if failed.step is not None else ""
        self.say(f"attempt {attempt + 1} failed{at}: {reason}; restarting ({attempt + 1} of {self.max_restarts}), "
                 f"resuming from the newest complete checkpoint")
        return True

    def say(self, text: str) -> None:
        print(f"{self.who}: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        try:
            lines = _time_lost(self.folder, self.history, last_restarted=self.succeeded)
            if lines:
                self.say("\n".join(lines))
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def run_with_restarts(command: Sequence[str], env: Mapping[str, str], *, max_restarts: int, straggle_s: float,
                      stop_grace: float) -> int:
    """Run torchrun's ``command`` under the supervisor, restarting it as the module docstring says; the exit code."""
    # deferred: start-up time (torch)
    from shardkit.distributed.supervise import SupervisedOutcome, run_supervised

    restarts = Restarts(max_restarts)
    try:
        for attempt in range(max_restarts + 1):
            outcome = SupervisedOutcome()
            code = run_supervised(command, {**env, **restarts.variables(attempt)}, straggle_s, stop_grace,
                                  outcome=outcome)
            if code == 0:
                restarts.succeeded = True
                return 0
            if not restarts.failed(attempt, code, outcome, time.time()):
                return code
        raise AssertionError("unreachable")
    finally:
        restarts.close()


def launch_with_restarts(fn: Callable[..., Any], args: Sequence[Any] = (), *, max_restarts: int,
                         env: Mapping[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """:func:`shardkit.launch` restarted as ``shardkit launch --max-restarts`` restarts a script: ``fn`` runs again on
    every rank after a failure, told it is a restart (its Runner resumes), until it succeeds, fails the same way
    twice without progress, or ``max_restarts`` are used up; then the last ``LaunchError`` is raised. Always in
    child processes (a failure in this process could not be restarted). ``kwargs`` go to ``launch``."""
    # deferred: start-up time (torch)
    from shardkit.distributed.launcher import LaunchError, launch

    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts({max_restarts!r}) must be a whole number >= 0")
    restarts = Restarts(max_restarts, who="shardkit.launch")
    try:
        for attempt in range(max_restarts + 1):
            try:
                result = launch(fn, args, env={**(env or {}), **restarts.variables(attempt)}, in_process=False,
                                **kwargs)
            except LaunchError as err:
                ended = time.time()
                # the ranks' errors came back through the launcher, not through an excepthook: record them here
                for rank, text in err.tracebacks.items():
                    lines = [line for line in text.strip().splitlines() if line and not line.startswith(" ")]
                    write_error(restarts.folder, attempt, rank, lines[-1] if lines else "unknown error", ended)
                signals = {rank: -code for rank, code in err.exitcodes.items() if code is not None and code < 0}
                outcome = _Outcome(signals, list(err.hung_ranks))
                if not restarts.failed(attempt, 1, outcome, ended):
                    raise
                continue
            restarts.succeeded = True
            return result
        raise AssertionError("unreachable")
    finally:
        restarts.close()


@dataclass
class _Outcome:
    signals: dict[int, int]
    hung: list[int]
    first_exit: float | None = None


def _time_lost(folder: str, history: Sequence[Attempt], last_restarted: bool) -> list[str]:
    """One line per failure that was restarted: detection + restart + load + replayed steps, as the job measured
    them (the Runner logs the same figures to its trackers); none when nothing was restarted."""
    if not history or (len(history) == 1 and not last_restarted):
        return []
    lines = ["time lost per failure (detection + restart + load + replayed steps):"]
    for index, failed in enumerate(history, start=1):
        record = read_recovery(folder, index)
        if index == len(history) and not last_restarted:
            continue  # the last failure was not restarted (or its restart did not get that far)
        if record is None:
            lines.append(f"  failure {index} ({'; '.join(failed.causes)}): not measured (its restart failed before "
                         "it caught up, or the job does not use the Runner)")
            continue
        lines.append(f"  failure {index}: {record['detect_s']:.2f} + {record['restart_s']:.2f} + "
                     f"{record['load_s']:.2f} + {record['replay_s']:.2f} s ({record.get('replayed_steps', 0)} "
                     f"step(s)) = {record['lost_s']:.2f} s; resumed from step {record.get('from_step')}")
    return lines
