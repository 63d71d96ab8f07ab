"""What every corpus test of tests/faults/ does with a case: run the read, judge what came out, print the count."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from shardkit.checkpoint import CheckpointError

__all__ = ["outcome", "report", "verdict"]


def outcome(read: Callable[[], object], timeout: float | None = None, fifos: Path | None = None) -> object:
    """The exception ``read()`` raised (None: none). With ``timeout`` it runs on a thread and "blocked" comes back
    when it did not return in time; a reader blocked opening a FIFO under ``fifos`` is then let go (a writer
    end arrives)."""
    if timeout is None:
        try:
            read()
        except Exception as e:  # noqa: BLE001 - whatever comes out is the outcome under test
            return e
        return None
    result: list = []
    t = threading.Thread(target=lambda: result.append(outcome(read)), daemon=True)
    t.start()
    t.join(timeout)
    if result:
        return result[0]
    for f in (fifos.rglob("*") if fifos is not None else ()):
        if f.is_fifo():
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
    return "blocked"


def verdict(got: object, texts: str | Iterable[str]) -> str | None:
    """None when ``got`` is a CheckpointError whose message holds every one of ``texts``, else what is wrong."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if isinstance(got, CheckpointError):
        missing = [t for t in texts if t not in str(got)]
        return f"message lacks {missing}: {str(got)[:400]}" if missing else None
    if got is None:
        return "read without an error"
    return got if isinstance(got, str) else f"{type(got).__name__}: {str(got)[:400]}"


def report(capsys, corpus: str, cases: str, total: int, failures: dict, extra: str = "") -> None:
    """Prints ``"<corpus>: N of M <cases> give a named CheckpointError<extra>"`` past pytest's capture."""
    with capsys.disabled():
        print(f"\n{corpus}: {total - len(failures)} of {total} {cases} give a named CheckpointError{extra}")
