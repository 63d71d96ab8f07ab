"""Saves that do not stall training: stage on the main thread, write and publish on a background thread.

The main thread runs everything that talks to other ranks or reads live training state: the strategy's gathers
(while it writes into a :class:`~shardkit.checkpoint.staging.StagingWriter`, which copies each tensor), and the
writer's ``open`` (rank 0 locks the parent and tells every rank the temporary directory through the Runner's
broadcast). A background thread then replays the writes into that :class:`CheckpointWriter` and commits it: the
files, their fsyncs and hashes, every rank's manifest part, and rank 0's checked publish (rename, ``latest``,
pruning) are the synchronous save's own code, so a kill at any point leaves the previous checkpoint whole and
``latest`` moves only after the new one is complete.

The commit's two barriers run on the background thread, on a process group of their own: a gloo group made once,
on the main thread, by every rank (as torch.distributed.checkpoint's ``async_save`` takes a gloo group for its
thread). Collectives of one group never interleave with the training's collectives on another, and gloo runs each
group on its own connections, so the background barriers cannot reorder or block the main thread's.

At most one save is in flight: :meth:`AsyncCheckpointer.wait` (called by the next save, by ``load`` and by
``teardown``) joins it, and raises a :class:`CheckpointError` naming the checkpoint when it failed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from .format import CheckpointError
from .staging import StagingBuffers, StagingWriter
from .writer import CheckpointWriter

__all__ = ["AsyncCheckpointer", "SaveTimes"]


class SaveTimes:
    """Where an asynchronous save spent its time, in seconds: ``staged`` (the main thread's copies and gathers,
    what the step loop waits for) and ``written`` (the background thread's writing and publishing)."""

    def __init__(self) -> None:
        self.staged = 0.0
        self.written = 0.0
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"SaveTimes(staged={self.staged:.3f}s, written={self.written:.3f}s, bytes={self.nbytes})"


class AsyncCheckpointer:
    """Runs one background save at a time for a Runner (or any loop with the same collectives).

    Args:
        rank: this process's rank.
        world_size: the ranks taking part; above 1 a gloo group for the background barriers is made on the first
            save (every rank must save together, as with a synchronous save).
        timeout_s: how long a background barrier waits for the other ranks.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.buffers = StagingBuffers()
        self.last = SaveTimes()
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._published = False
        self._group: Any = None

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint being written now, or None."""
        return self._path if self._thread is not None and self._thread.is_alive() else None

    def save(self, path: str | Path, make_writer: Callable[..., CheckpointWriter],
             fill: Callable[[StagingWriter], None], on_done: Callable[[Path], None] | None = None) -> None:
        """Save ``path`` in the background: wait for the previous save, open the writer (rank 0 locks and makes the
        temporary directory; a collective), let ``fill`` write the state into a staging writer (the strategy's
        gathers run here), then write and publish on a background thread.

        Args:
            path: the checkpoint directory.
            make_writer: builds the :class:`CheckpointWriter` for ``path`` given ``barrier=`` (the background
                barrier, None for one rank).
            fill: writes the state into the staging writer it is given (on this thread).
            on_done: called on the background thread with ``path`` once the checkpoint is published (file work
                only, no collectives).

        Raises:
            CheckpointError: the previous background save failed (nothing of this one was started), or this save
                could not start (then every rank raises, as a synchronous save does).
        """
        self.wait()
        start = time.perf_counter()
        writer = make_writer(barrier=self._barrier())
        writer.open()
        staged = StagingWriter(path, self.rank, self.world_size, self.buffers)
        try:
            fill(staged)
        except BaseException as err:  # the other ranks' threads commit: abort keeps the barriers in step
            writer.abort(err)
            raise
        self._path, self._error, self._published = staged.path, None, False
        self.last = SaveTimes()
        self.last.nbytes, self.last.staged = staged.nbytes, time.perf_counter() - start
        # NOTE: not a daemon: an interpreter that exits without teardown() still finishes the save it started.
        self._thread = threading.Thread(target=self._write, args=(staged, writer, on_done),
                                        name=f"shardkit-save-{staged.path.name}", daemon=False)
        self._thread.start()

    def _write(self, staged: StagingWriter, writer: CheckpointWriter, on_done: Callable[[Path], None] | None) -> None:
        start = time.perf_counter()
        try:
            try:
                staged.replay(writer)
            except BaseException as err:
                writer.abort(err)
                raise
            writer.commit()
            self._published = True
            if on_done is not None:
                on_done(staged.path)
        except BaseException as err:  # kept for the next call on the main thread, which raises it
            self._error = err
        finally:
            self.last.written = time.perf_counter() - start

    def wait(self) -> Path | None:
        """Block until the save in flight is published; return its path (None when there was none).

        Raises:
            CheckpointError: the background save failed; names the checkpoint, and chains the cause.
        """
        thread, path = self._thread, self._path
        if thread is None:
            return None
        thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None and self._published:
            raise CheckpointError(f"the background save of {path} was published, but what runs after it failed: "
                                  f"{error}") from error
        if error is not None:
            raise CheckpointError(f"the background save of {path} failed: {error}. Nothing of it was published: "
                                  "the previous checkpoint and `latest` are unchanged") from error
        return path

    def close(self) -> None:
        """Wait for the save in flight (raising its failure), then free the staging buffers and the group."""
        try:
            self.wait()
        finally:
            self.buffers.release()
            self._group = None

    def _barrier(self) -> Callable[[], None] | None:
        if self.world_size == 1:
            return None
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CheckpointError(f"blocking=False with world_size={self.world_size} needs torch.distributed "
                                  "initialised (the Runner's strategy does it)")
        if self._group is None:  # a collective: every rank makes it here, on the main thread, at the first save
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        group = self._group
        return lambda: dist.barrier(group=group)
