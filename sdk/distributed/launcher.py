"""`launch(fn, args, num_processes)`: run a function on N local processes and collect what each returns.

From a script, the default start method "spawn" starts fresh interpreters: `fn` and `args` are
pickled, so `fn` must be a top-level function of an importable module.

In a notebook, use `start_method="fork"`: functions defined in the notebook cannot be imported by
spawned children, and forked children share the parent's memory. Build the model once, on the CPU,
in the notebook and pass it in `args`; each worker then moves it to its device. Building it inside
`fn` would make every worker build its own copy and can exhaust host memory. Do not touch CUDA in
the notebook before forking (a forked child cannot use a CUDA context it inherited).

Each child gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free
port), so `init_distributed()` inside `fn` joins the job. When a rank fails, the others get a short
grace period to report their own errors, are then stopped, and `LaunchError` names every failed
rank with its exit code or signal and traceback.

Every job ends: a rank that hangs inside a collective is named by its peers (they time out and find out
which rank never arrived, see `shardkit.distributed.watchdog`); a rank still running the collective timeout
plus `GRACE_PERIOD_S` after another returned (it hangs after its last collective) is stopped and named;
SIGTERM or SIGINT sent to the launching process is forwarded to every rank, which gets `stop_grace`
seconds to save before it is killed.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator, Mapping, Sequence

from shardkit.distributed import watchdog
from shardkit.distributed.cluster import find_free_port
from shardkit.distributed.process_group import (
    check_timeout,
    cpu_budget,
    default_timeout,
    destroy_distributed,
)
from shardkit.distributed.restart_records import RESTART_VARIABLES
from shardkit.distributed.signals import STOP_GRACE_S, catch_stop_signals, redeliver

__all__ = ["GRACE_PERIOD_S", "LaunchError", "LaunchTimeout", "find_free_port", "launch"]

# After the first failure the other ranks get this long to exit on their own: a peer blocked in a
# gloo collective raises within ~0.1 s of the failed rank's sockets closing, and its own traceback
# ("Connection closed by peer") tells the reader that it was a consequence, not a second bug.
GRACE_PERIOD_S = 3.0
# Between SIGTERM and SIGKILL for ranks that ignore or hang in their SIGTERM handler.
KILL_AFTER_S = 2.0

_RESERVED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
# Inherited from an enclosing torchrun, these would send the children to the wrong rendezvous store; an enclosing
# restarting launcher's would make a first start a restart (see restart_records.RESTART_VARIABLES).
_STRIPPED = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", *RESTART_VARIABLES)
_ENV_LOCK = threading.RLock()


class LaunchError(RuntimeError):
    """One or more ranks failed. The message names each with its exit code or signal and traceback.

    Attributes:
        failed_ranks: ranks that failed, the root cause first: a rank its peers name as never arriving
            at a collective, then the first failure.
        hung_ranks: ranks named as hung: peers timed out waiting for them in a collective, or they kept
            running after another rank returned (longer than the collective timeout plus a grace).
        still_running: ranks alive when the launch gave up (timeout), else empty.
        exitcodes: rank -> exit code (negative: killed by that signal; None: never exited).
        tracebacks: rank -> formatted traceback, for ranks that raised.
    """

    def __init__(self, message: str, failed_ranks: Sequence[int] = (), still_running: Sequence[int] = (),
                 exitcodes: Mapping[int, int | None] | None = None, tracebacks: Mapping[int, str] | None = None,
                 hung_ranks: Sequence[int] = ()):
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)
        self.hung_ranks = list(hung_ranks)
        self.still_running = list(still_running)
        self.exitcodes = dict(exitcodes or {})
        self.tracebacks = dict(tracebacks or {})


class LaunchTimeout(LaunchError):
    """The overall `timeout` of `launch` ran out; `still_running` names the ranks that were killed."""


def launch(fn: Callable[..., Any], args: Sequence[Any] = (), num_processes: int | None = None,
           start_method: str = "spawn", timeout: float | None = None,
           env: Mapping[str, str] | None = None, in_process: bool | None = None,
           stop_grace: float = STOP_GRACE_S) -> list[Any]:
    """Run `fn(*args)` on `num_processes` local processes and return each rank's result, in rank order.

    Args:
        fn: the function every rank runs; it may call `init_distributed()` to join the process
            group (left-over groups are destroyed when it returns). With "spawn" it must be a
            top-level function of an importable module. A rank process ends right after sending
            its result (`os._exit`): atexit hooks registered inside `fn` do not run.
        args: positional arguments for `fn`, the same on every rank (pickled with "spawn").
        num_processes: number of ranks; default one per visible CUDA device, else 1. With 1,
            `fn` runs in this process unless `in_process=False`: no pickling, exceptions propagate
            unchanged, `timeout` is not enforced, and the rank variables and `env` are set only
            for the call.
        start_method: "spawn" (default), "fork" (notebooks; see the module docstring) or
            "forkserver".
        timeout: seconds for the whole job; when it runs out every rank is killed and
            `LaunchTimeout` names the ranks still running. None: no limit.
        env: extra environment variables for every rank, e.g. {"SHARDKIT_COLLECTIVE_TIMEOUT": "20"}.
        in_process: None (default): in this process exactly when there is one rank; False: always
            in child processes (tests that need a fresh process or an enforced timeout).
        stop_grace: seconds the ranks get to save after SIGTERM/SIGINT reaches this process (forwarded
            to them as SIGTERM) before they are killed; the signal then acts here as it would have.

    Returns:
        `[result of rank 0, result of rank 1, ...]`; results must be picklable.

    Raises:
        LaunchError: a rank raised, exited without a result or was killed by a signal.
        LaunchTimeout: `timeout` ran out.
    """
    n = _resolve_num_processes(num_processes)
    extra = _check_env(env)
    if timeout is not None:
        check_timeout(timeout, f"timeout({timeout!r})")
    check_timeout(stop_grace, f"stop_grace({stop_grace!r})")
    # A malformed collective timeout fails here, once, rather than in every rank.
    collective = default_timeout({**os.environ, **extra})
    if in_process and n > 1:
        raise ValueError(f"in_process=True needs num_processes=1, got {n}")
    if n == 1 and in_process is not False:
        return [_run_in_process(fn, tuple(args), extra)]
    _check_start_method(fn, start_method)
    policy = _Policy(timeout, collective + GRACE_PERIOD_S, stop_grace)
    with catch_stop_signals() as received:
        ranks = _start(fn, tuple(args), n, mp.get_context(start_method), extra)
        try:
            still_running = _monitor(ranks, policy, received)
        finally:
            for state in ranks:  # Ctrl-C in a notebook, or a bug here: leave no orphans.
                if state.process.is_alive():
                    state.process.kill()
                state.process.join()
                state.conn.close()
    if received:
        redeliver(received[0])
    _raise_if_failed(ranks, policy, still_running)
    return [state.result for state in ranks]


def _run_in_process(fn: Callable[..., Any], args: tuple, extra: dict[str, str]) -> Any:
    import torch.distributed as dist

    had_group = dist.is_available() and dist.is_initialized()
    with _patched_environ({**_rank_env(0, 1, "127.0.0.1", find_free_port()), **extra}, remove=_STRIPPED):
        try:
            return fn(*args)
        finally:
            if not had_group:
                destroy_distributed()


def _resolve_num_processes(num_processes: int | None) -> int:
    if num_processes is None:
        import torch

        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes({num_processes!r}) must be an integer >= 1")
    return num_processes


def _check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    reserved = sorted(set(extra) & set(_RESERVED))
    if reserved:
        raise ValueError(f"env sets {reserved}, which launch sets per rank; pass num_processes instead")
    return extra


def _check_start_method(fn: Callable[..., Any], start_method: str) -> None:
    if start_method not in mp.get_all_start_methods():
        raise ValueError(f"start_method({start_method!r}) is not one of {mp.get_all_start_methods()}")
    if start_method == "fork":
        import torch

        if torch.cuda.is_initialized():
            raise RuntimeError("CUDA is already initialised in this process, and forked children cannot use it; "
                               "build the model on the CPU before launch(..., start_method='fork') and move it "
                               "to the device inside fn, or use start_method='spawn'")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError("this process already has a process group; forked children would inherit it. "
                               "Call destroy_distributed() first or use start_method='spawn'")
    main = sys.modules.get("__main__")
    if start_method != "fork" and getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} is defined in an interactive session, which "
                         f"{start_method!r} children cannot import; use start_method='fork' in a notebook")


@dataclass(frozen=True)
class _Policy:
    """When the launcher gives up on ranks: the job `timeout`, `straggle_s` after the first rank returned
    (collective timeout + grace), `stop_grace` between a forwarded SIGTERM and SIGKILL."""

    timeout: float | None
    straggle_s: float
    stop_grace: float


@dataclass
class _Rank:
    rank: int
    process: Any
    conn: Connection
    result: Any = None
    has_result: bool = False
    traceback: str | None = None
    failed_at: float | None = None
    finished_at: float | None = None
    stopped_by_launcher: bool = False
    straggler: bool = False
    missing: list[int] | None = None  # ranks this one timed out waiting for
    open: bool = True

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode


def _rank_env(rank: int, world_size: int, addr: str, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


@contextlib.contextmanager
def _patched_environ(values: Mapping[str, str], remove: Sequence[str] = ()) -> Iterator[None]:
    """Set variables in os.environ for the block; spawned and forked children inherit them from birth."""
    with _ENV_LOCK:
        saved = {key: os.environ.get(key) for key in (*values, *remove)}
        try:
            for key in remove:
                os.environ.pop(key, None)
            os.environ.update(values)
            yield
        finally:
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old


def _start(fn: Callable[..., Any], args: tuple, n: int, ctx: Any, extra: dict[str, str]) -> list[_Rank]:
    addr = extra.get("MASTER_ADDR", "127.0.0.1")
    port = int(extra.get("MASTER_PORT") or find_free_port())
    threads = None
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in extra:
        threads = max(1, cpu_budget() // n)  # N ranks share the cores instead of each taking all.
        extra = {**extra, "OMP_NUM_THREADS": str(threads)}
    # Forkserver children are forked from a server started earlier, with the environment of that moment: they get
    # this process's whole environment now (what spawn and fork children inherit), which _worker installs exactly.
    inherited = ({k: v for k, v in os.environ.items() if k not in _STRIPPED}
                 if ctx.get_start_method() == "forkserver" else {})
    ranks: list[_Rank] = []
    try:
        for rank in range(n):
            variables = {**inherited, **extra, **_rank_env(rank, n, addr, port)}
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker, args=(fn, args, variables, threads, writer, bool(inherited)),
                                  name=f"shardkit-rank-{rank}", daemon=False)
            with _patched_environ(variables, remove=_STRIPPED):
                process.start()
            writer.close()  # Our copy: without closing it the reader never sees EOF.
            ranks.append(_Rank(rank, process, reader))
    except Exception as err:
        for state in ranks:
            state.process.kill()
            state.process.join()
        if "pickle" in type(err).__name__.lower() or "pickle" in str(err).lower():
            raise LaunchError(f"could not send fn/args to the children: {err}. With start_method='spawn' fn must "
                              "be a top-level function and args picklable; in a notebook use "
                              "start_method='fork'") from err
        raise
    return ranks


def _monitor(ranks: list[_Rank], policy: _Policy, received: list[int]) -> list[int] | None:
    """Collect results until every rank has exited; if the timeout runs out, return the ranks still running.

    Stops the job (SIGTERM, then SIGKILL) a grace after the first failure, at once when this process got
    SIGTERM/SIGINT (then with `policy.stop_grace` before SIGKILL), and when ranks keep running
    `policy.straggle_s` after another returned (they are marked as failed stragglers).
    """
    deadline = None if policy.timeout is None else time.monotonic() + policy.timeout
    term_at = kill_at = None
    kill_after = KILL_AFTER_S
    while any(state.process.exitcode is None or state.open for state in ranks):
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return [state.rank for state in ranks if state.process.exitcode is None]
        if received and kill_after != policy.stop_grace:
            term_at, kill_at, kill_after = now, None, policy.stop_grace  # forward the signal at once
        first_failure = min((s.failed_at for s in ranks if s.failed_at is not None), default=None)
        if first_failure is not None and term_at is None:
            term_at = first_failure + GRACE_PERIOD_S
        straggle_at = _straggle_deadline(ranks, policy.straggle_s) if term_at is None else None
        if straggle_at is not None and now >= straggle_at:
            for state in ranks:
                if state.process.exitcode is None:
                    state.straggler, state.failed_at = True, now
            term_at = now
        if term_at is not None and now >= term_at and kill_at is None:
            kill_at = now + kill_after
            for state in ranks:
                if state.process.exitcode is None:
                    state.stopped_by_launcher = True
                    state.process.terminate()
        if kill_at is not None and now >= kill_at:
            for state in ranks:
                if state.process.exitcode is None:
                    state.process.kill()
        waits = [t - now for t in (deadline, term_at, kill_at, straggle_at) if t is not None and t > now]
        objects = [s.conn for s in ranks if s.open] + [s.process.sentinel for s in ranks if s.process.exitcode is None]
        # NOTE: at most 0.5 s: a signal's handler runs inside wait() and wait() then resumes its full timeout.
        wait(objects, timeout=min([*waits, 0.5]) if objects else 0.05)
        now = time.monotonic()
        for state in ranks:
            _poll(state, now)
    return None


def _straggle_deadline(ranks: list[_Rank], straggle_s: float) -> float | None:
    """When ranks still running after another returned count as hung (after their last collective)."""
    first = min((s.finished_at for s in ranks if s.finished_at is not None), default=None)
    if first is None or all(s.process.exitcode is not None for s in ranks):
        return None
    return first + straggle_s


def _poll(state: _Rank, now: float) -> None:
    # Read the exit code before draining: whatever a rank sent before it exited is then in the pipe.
    exitcode = state.process.exitcode
    while state.open and state.conn.poll():
        try:
            kind, payload = pickle.loads(state.conn.recv_bytes())
        except (EOFError, OSError):
            state.open = False
            break
        if kind == "ok":
            state.result, state.has_result = payload, True
        elif kind == "missing":
            state.missing = payload
        else:
            state.traceback = payload
            state.failed_at = state.failed_at or now
    if exitcode is None:
        return
    state.open = False  # A grandchild (a DataLoader worker) holding the pipe open must not keep us waiting.
    # A rank the launcher stopped after another failed is reported as stopped, not as a failure.
    if state.failed_at is None and not state.stopped_by_launcher and (exitcode != 0 or not state.has_result):
        state.failed_at = now
    if exitcode == 0 and state.has_result and state.finished_at is None:
        state.finished_at = now


def _describe_exit(state: _Rank) -> str:
    code = state.exitcode
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    if code == 0 and not state.has_result:
        return "exited with code 0 without returning a result (os._exit or sys.exit in fn?)"
    return f"exited with code {code}"


def _failure_order(state: _Rank) -> tuple:
    # A rank whose error only says that its peer went away ("Connection reset by peer") is a consequence,
    # not the cause: list it after the others whatever the timing (a SIGKILLed rank's sockets close
    # before its exit status can be read, so its peer's error may arrive first).
    consequence = bool(state.traceback) and "by peer" in state.traceback.strip().splitlines()[-1]
    return (consequence, state.failed_at, state.rank)


def _hung(ranks: list[_Rank]) -> dict[int, str]:
    """rank -> why it is named as hung: peers timed out waiting for it, or it outlived the others."""
    hung: dict[int, str] = {}
    for state in ranks:
        for rank in state.missing or ():
            waiting = [s.rank for s in ranks if rank in (s.missing or ())]
            hung.setdefault(rank, f"rank {rank} did not arrive at a collective: rank(s) {waiting} timed out "
                                  f"waiting for it")
    finished = [s.rank for s in ranks if s.finished_at is not None]
    for state in ranks:
        if state.straggler:
            hung.setdefault(state.rank, f"rank {state.rank} was still running after rank(s) {finished} had "
                                        f"returned, longer than the collective timeout plus "
                                        f"{GRACE_PERIOD_S:g} s: it hangs after its last collective")
    return hung


def _raise_if_failed(ranks: list[_Rank], policy: _Policy, still_running: list[int] | None) -> None:
    hung = _hung(ranks)
    failed = sorted((s for s in ranks if s.failed_at is not None or s.rank in hung),
                    key=lambda s: (s.rank not in hung, *_failure_order(s)))
    timed_out = still_running is not None
    if not failed and not timed_out:
        return
    lines: list[str] = [f"{why}; it was stopped by the launcher ({_describe_exit(ranks[rank])})"
                        for rank, why in hung.items()]
    if timed_out:
        lines.append(f"launch timed out after {policy.timeout:g} s with rank(s) {still_running} still running; "
                     "they were killed")
    for index, state in enumerate(s for s in failed if s.rank not in hung):
        first = " (first to fail)" if index == 0 and len(failed) > 1 and not hung else ""
        last = state.traceback.strip().splitlines()[-1] if state.traceback else "no Python traceback"
        lines.append(f"rank {state.rank}{first} {_describe_exit(state)}: {last}")
    for state in ranks:
        if state.stopped_by_launcher and state.failed_at is None and state.rank not in hung and not timed_out:
            lines.append(f"rank {state.rank} was stopped by the launcher after rank {failed[0].rank} failed "
                         f"({_describe_exit(state)})")
    for state in failed:
        if state.traceback:
            lines.append(f"\n--- rank {state.rank} traceback ---\n{state.traceback.rstrip()}")
    error = LaunchTimeout if timed_out else LaunchError
    raise error("\n".join(lines), failed_ranks=[s.rank for s in failed], still_running=still_running or [],
                exitcodes={s.rank: s.exitcode for s in ranks},
                tracebacks={s.rank: s.traceback for s in ranks if s.traceback}, hung_ranks=list(hung))


def _worker(fn: Callable[..., Any], args: tuple, variables: dict[str, str], threads: int | None,
            conn: Connection, whole_environ: bool = False) -> None:
    """Child side: set the rank's variables, run fn, send ("ok", result) or ("error", traceback).

    ``whole_environ``: ``variables`` is the launching process's entire environment (a forkserver child), which
    replaces the server's."""
    if whole_environ:
        os.environ.clear()
    for key in _STRIPPED:
        os.environ.pop(key, None)
    os.environ.update(variables)  # Spawned and forked children have them from birth; a forkserver child gets them here.
    if threads is None and whole_environ and variables.get("OMP_NUM_THREADS", "").strip().isdigit():
        # torch read OMP_NUM_THREADS when the server imported it, before this rank's environment existed.
        threads = max(1, int(variables["OMP_NUM_THREADS"]))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # A forked child keeps the parent's thread count otherwise.
    try:
        result = fn(*args)
        destroy_distributed()
        message: tuple[str, Any] = ("ok", result)
    except BaseException as err:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are reported too.
        message = ("error", traceback.format_exc())
        report = watchdog.explain(err)  # which peers never arrived, when a collective timed out
        if report is not None:
            conn.send_bytes(pickle.dumps(("missing", report.missing)))
            if not isinstance(err, watchdog.CollectiveTimeoutError):
                message = ("error", f"{message[1]}shardkit: {report.message}\n")
    # NOTE: plain pickle bytes, not conn.send: multiprocessing's pickler moves tensors through shared
    # memory whose file descriptors die with this process, so a returned tensor would arrive broken.
    try:
        conn.send_bytes(pickle.dumps(message))
    except Exception:
        message = ("error", f"rank {variables['RANK']}'s result could not be sent back:\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(message))
    conn.close()
    if message[0] == "ok":
        _release_named_semaphores()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    # NOTE: os._exit, not a normal exit, on both paths. A failed rank: atexit hooks (NCCL, DeepSpeed) can
    # block on peers that are themselves waiting for it; exiting closes its sockets at once. A rank whose
    # result is delivered has nothing left to do, and interpreter finalization of leftover distributed state
    # (process groups, engine threads) has aborted ranks ("terminate called without an active exception",
    # SIGABRT) on the loaded 2-core CI machine, failing a job whose every rank had succeeded.
    os._exit(1 if message[0] == "error" else 0)


def _release_named_semaphores() -> None:
    """Run the finalizers a normal multiprocessing child runs at exit (exit priority >= 0).

    Locks made in the rank (tqdm's multiprocessing lock, a DataLoader's queues) are named semaphores the
    parent's resource tracker is told about; their finalizers tell it they are gone. ``os._exit`` below skips
    them, and the parent then warned "There appear to be N leaked semaphore objects" after every clean run.
    """
    try:
        from multiprocessing import util

        util._run_finalizers(0)  # NOTE: private, stable since Python 3.4; what Process._bootstrap calls at exit
    except Exception:  # noqa: BLE001 - a result was delivered: cleanup must not turn it into a failure
        pass
