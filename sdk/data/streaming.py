"""Streamed (iterable) data for a Runner: dealt to ranks in one global order, resumed exactly mid-epoch.

A :class:`ChunkedStream` reads a source of examples (a Hugging Face ``datasets.IterableDataset``, a torch
``IterableDataset``, any re-iterable) chunk by chunk and turns each chunk into items (e.g. tokenized and packed
rows). Items are numbered in one global order, the same on every rank, and item ``g`` of the current split goes
to rank ``(g - offset) % world_size`` (as :class:`~shardkit.data.loader.ResumableSampler` deals a map-style epoch), so
ranks take the same number of batches; the last round is padded with repeats of its own items.

Resuming: a checkpoint holds how many items of the epoch all ranks together have consumed, and where the chunk
of this rank's last item began in the source. A resumed run, at any world size, seeks the source to that chunk,
rebuilds it, and deals the items after the consumed ones anew over its ranks: every remaining item once. Seeking
uses the source's own ``state_dict``/``load_state_dict`` (Hugging Face ``IterableDataset``: shards before the
position are not opened, and at most one chunk is read again); a source without them is re-read from its start
and the consumed examples are skipped without being transformed.

Every rank reads the whole stream and keeps its share of it (as Accelerate's ``IterableDatasetShard`` does), in the
main process: DataLoader workers would each read a part and change the global order. Data kept in many files reads
only each rank's part instead: :class:`~shardkit.data.sharded_files.ShardedFiles`.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset

from shardkit.data.loader import RunnerDataLoader, rebuild_dataloader
from shardkit.data.sharded_files import ShardedFiles
from shardkit.data.sharded_loader import ShardedLoader
from shardkit.utils.operations import move_to_device

__all__ = ["ChunkedStream", "StreamPosition", "StreamingLoader", "is_stream", "rebuild_loader"]

logger = logging.getLogger("shardkit")

_MAX_STATE_BYTES = 1 << 16  # a source's position is a few counters: anything bigger in a checkpoint is not one


class StreamPosition(NamedTuple):
    """Where a chunk begins: the source's state before its first example, and the global index of its first item."""

    state: Any
    index: int


def is_stream(dataset: Any) -> bool:
    """True for data without random access: torch ``IterableDataset``, ``datasets.IterableDataset``, ChunkedStream."""
    if isinstance(dataset, IterableDataset):
        return True
    return type(dataset).__name__ == "IterableDataset" and type(dataset).__module__.startswith("datasets")


class ChunkedStream(IterableDataset):
    """Items made from a source of examples ``chunk_size`` at a time, restartable at any chunk.

    Args:
        source: a re-iterable of examples (each ``iter()`` starts from the beginning). With ``state_dict`` and
            ``load_state_dict`` (Hugging Face ``IterableDataset``) a restart seeks; otherwise it re-reads and skips.
        transform: ``f(list_of_examples) -> list_of_items`` applied to each chunk (default: the examples as they are).
        chunk_size: examples per chunk (items of a chunk may depend on each other, e.g. packed together).
    """

    def __init__(self, source: Iterable[Any], transform: Callable[[list[Any]], list[Any]] | None = None,
                 chunk_size: int = 1):
        if chunk_size < 1:
            raise ValueError(f"ChunkedStream: chunk_size={chunk_size} must be >= 1")
        self.source, self.transform, self.chunk_size = source, transform, chunk_size
        self.epoch = 0

    @property
    def seekable(self) -> bool:
        return callable(getattr(self.source, "state_dict", None)) and callable(getattr(self.source, "load_state_dict",
                                                                                       None))

    def set_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` of the source (a Hugging Face ``IterableDataset`` reshuffles its shards by it)."""
        self.epoch = epoch
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return (item for _, item, _ in self.iter_from(None))

    def iter_from(self, start: StreamPosition | None) -> Iterator[tuple[int, Any, StreamPosition]]:
        """``(global index, item, position of its chunk)`` from chunk ``start`` on (None: the source's beginning)."""
        start = start or StreamPosition(None, 0)
        examples = self._examples(start.state)
        state, index = start.state, start.index
        while True:
            chunk = [example for _, example in zip(range(self.chunk_size), examples)]
            if not chunk:
                return
            position = StreamPosition(state, index)
            items = self.transform(chunk) if self.transform is not None else chunk
            for item in items:
                yield index, item, position
                index += 1
            state = self._state_after(state, len(chunk))

    def _examples(self, state: Any) -> Iterator[Any]:
        if not self.seekable:
            skip = int(state or 0)
            iterator = iter(self.source)
            for _ in zip(range(skip), iterator):  # read again, not transformed
                pass
            return iterator
        # A copy per pass: Hugging Face's IterableDataset keeps a loaded state for every later pass of the same
        # epoch, and the user's object must stay as it was given.
        self._live = copy.deepcopy(self.source)
        if state is not None:
            self._live.load_state_dict(copy.deepcopy(state))
        return iter(self._live)

    def _state_after(self, state: Any, read: int) -> Any:
        if self.seekable:
            return copy.deepcopy(self._live.state_dict())
        return int(state or 0) + read

    def check_state(self, state: Any) -> Any:
        """A saved chunk state, checked against this source's own (every checkpoint file is hostile input).

        Raises:
            ValueError: naming what does not match.
        """
        if state is None:
            return None
        if len(json.dumps(state)) > _MAX_STATE_BYTES:
            raise ValueError(f"stream position holds more than {_MAX_STATE_BYTES} bytes; it is not a position")
        if not self.seekable:
            if not isinstance(state, int) or isinstance(state, bool) or state < 0:
                raise ValueError(f"stream position must be a count of examples >= 0 for this source, got {state!r:.40}")
            return state
        _same_shape(state, self.source.state_dict(), "stream position")
        return state


def _same_shape(saved: Any, live: Any, where: str) -> None:
    """``saved`` has ``live``'s keys and kinds: counters are integers >= 0, names are equal."""
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping) or set(saved) != set(live):
            got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
            raise ValueError(f"{where} has keys {got}, this source's has {sorted(live)}: resume with the same dataset")
        for key, value in live.items():
            _same_shape(saved[key], value, f"{where}.{key}")
    elif isinstance(live, list):
        if not isinstance(saved, list) or len(saved) != len(live):
            raise ValueError(f"{where} must be a list of {len(live)}: resume with the same dataset")
        for i, (a, b) in enumerate(zip(saved, live)):
            _same_shape(a, b, f"{where}[{i}]")
    elif isinstance(live, bool) or isinstance(live, str):
        if saved != live:
            raise ValueError(f"{where} is {saved!r:.40}, this source's is {live!r}: resume with the same dataset")
    elif isinstance(live, int):
        if not isinstance(saved, int) or isinstance(saved, bool) or saved < 0:
            raise ValueError(f"{where} must be an integer >= 0, got {saved!r:.40}")
    elif live is None:
        if saved is not None and not isinstance(saved, (Mapping, int)):
            raise ValueError(f"{where} must be empty, a counter or a nested state, got {type(saved).__name__}")


class _RankView(IterableDataset):
    """This rank's items of the current split, each with (global index, chunk position), padded in the last round."""

    def __init__(self, stream: ChunkedStream, rank: int, world: int, drop_last: bool):
        self.stream, self.rank, self.world, self.drop_last = stream, rank, world, drop_last
        self.anchor: StreamPosition | None = None  # the chunk to start reading at (index <= offset)
        self.offset = 0  # global index of the split's first item
        self.padding = 0  # a resumed split: how many of the `offset` items consumed may be end-of-epoch repeats
        self.length: int | None = None  # items in the split, known once the stream has ended

    def __iter__(self) -> Iterator[tuple[Any, tuple[int, StreamPosition]]]:
        last_round: list[tuple[Any, tuple[int, StreamPosition]]] = []
        mine_in_round, self.length, count = False, None, 0
        start = self.anchor.index if self.anchor is not None else 0
        items = start  # the source's items up to the last one read, by global index
        for index, item, position in self.stream.iter_from(self.anchor):
            items = index + 1
            if index < self.offset:
                continue
            count += 1
            slot = (index - self.offset) % self.world
            if slot == 0:
                last_round, mine_in_round = [], False
            last_round.append((item, (index, position)))
            if slot == self.rank:
                mine_in_round = True
                if not self.drop_last:
                    yield item, (index, position)
            if self.drop_last and slot == self.world - 1:
                # Only whole rounds under drop_last: a short last round would leave the ranks with different
                # numbers of items, so some would run a step the others never join.
                yield last_round[self.rank]
        if items < self.offset - self.padding:
            # A resumed split starts after the items the checkpoint consumed: a source that ends before them is
            # not the data the checkpoint was written with (the epoch would be silently empty or short).
            raise ValueError(f"resuming a stream at item {self.offset} (the checkpoint's position in epoch "
                             f"{self.stream.epoch}), but the source "
                             + (f"ended after {items} items" if items > start else f"has no item from {start} on")
                             + ": the data changed since the checkpoint was written. Resume with the same data, or "
                             "start a fresh run (no resume_from_checkpoint)")
        self.length = count
        if last_round and not mine_in_round and not self.drop_last:
            # The last round is short: repeat its items, as a sampler pads the end of a split.
            yield last_round[self.rank % len(last_round)]


class _SplitCollate:
    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: list[tuple[Any, tuple[int, StreamPosition]]]) -> tuple[Any, list]:
        return self.collate_fn([s for s, _ in samples]), [m for _, m in samples]


class StreamingLoader(RunnerDataLoader):
    """The Runner's loader for a stream: batches this rank's share and saves a position any world size resumes.

    Built by :meth:`shardkit.Runner.setup_dataloader` for a DataLoader over an iterable dataset. It has no length
    (``len()`` raises TypeError): train by steps (``max_steps``). Each ``iter()`` is the next epoch, or the rest
    of a resumed one.
    """

    def __init__(self, loader: DataLoader, rank: int, world_size: int, seed: int, device: torch.device):
        if loader.batch_size is None:
            raise ValueError("setup_dataloader needs a DataLoader built with batch_size=... for a streamed dataset: "
                             "ranks take their share item by item")
        dataset = loader.dataset
        stream = dataset if isinstance(dataset, ChunkedStream) else ChunkedStream(dataset)
        if loader.num_workers > 0:
            logger.warning("a streamed dataset is read in the main process (num_workers=%d ignored): workers would "
                           "each read part of the stream and the order, and so an exact resume, would be lost",
                           loader.num_workers)
        self.view = _RankView(stream, rank, world_size, loader.drop_last)
        batches = DataLoader(self.view, batch_size=loader.batch_size, collate_fn=_SplitCollate(loader.collate_fn),
                             drop_last=loader.drop_last)
        super().__init__(batches, sampler=None, device=device)
        self.stream, self.seed = stream, seed
        self.samples_seen = 0  # this rank's items consumed in the current split
        self._anchor: StreamPosition | None = None  # chunk of this rank's last consumed item
        self.at_end = False  # the batch being used is the epoch's last

    @property
    def dataset(self) -> Any:
        return self.stream.source if self.stream.transform is None else self.stream

    def __len__(self) -> int:
        raise TypeError("a streamed dataset has no length: train with max_steps")

    def set_epoch(self, epoch: int) -> None:
        if self._resume and epoch == self.epoch:
            return
        self.epoch, self.batches_seen, self._resume, self._started = epoch, 0, False, False
        self._new_split(None, 0)

    def _new_split(self, anchor: StreamPosition | None, offset: int, padding: int = 0) -> None:
        self.view.anchor, self.view.offset, self._anchor, self.samples_seen = anchor, offset, anchor, 0
        self.view.padding = padding

    def __iter__(self) -> Iterator[Any]:
        if self._resume:
            self._resume = False
        elif self._started:
            self.epoch += 1
            self.batches_seen = 0
            self._new_split(None, 0)
        self._started = True
        self.stream.set_epoch(self.epoch)
        fresh, count = self.view.anchor is None and self.view.offset == 0, 0
        batches = iter(self.loader)
        pending = next(batches, None)
        while pending is not None:
            batch, meta = pending
            # One batch is read ahead, so that the last one is known while it is used (``at_end``); the position
            # counts only the batches handed out.
            pending = next(batches, None)
            self.at_end = pending is None
            self._last_batch_start = self.samples_seen
            self.samples_seen += len(meta)
            self._anchor = meta[-1][1]
            self._last_batch_size = len(meta)
            self.batches_seen += 1
            count += 1
            yield move_to_device(batch, self.device)
        self.at_end = False
        if fresh and not count:
            raise ValueError(f"the streamed dataset gave no batch in epoch {self.epoch} (empty, or all of it dropped "
                             "by drop_last): check the data")

    def duplicate_mask(self) -> torch.Tensor | None:
        """For the rank-major gather of the epoch's last batch, a mask of the samples that are real (not the repeats
        padding the split's last round); None for any other batch. The batch read ahead tells which is the last, and
        by then every rank has walked the whole stream, so each counts the split's items alike."""
        view, size = self.view, self._last_batch_size
        if not self.at_end or view.drop_last or view.length is None:
            return None
        start = self._last_batch_start
        if (start + size) * view.world <= view.length:
            return None
        k = torch.arange(start, start + size)
        positions = k.unsqueeze(0) * view.world + torch.arange(view.world).unsqueeze(1)
        return (positions < view.length).reshape(-1)

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the split (offset, world size), this rank's items in it, and the chunk to restart from."""
        anchor = self._anchor or StreamPosition(None, 0)
        return {"epoch": self.epoch, "batches_seen": self.batches_seen, "seed": self.seed, "offset": self.view.offset,
                "world_size": self.view.world, "samples_seen": self.samples_seen,
                "stream": {"state": anchor.state, "index": anchor.index}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved epoch after the items every rank had consumed, dealt over this run's ranks."""
        checked = _check_stream_state(state, self.seed, self.stream)
        consumed = checked["offset"] + checked["samples_seen"] * checked["world_size"]
        anchor = StreamPosition(checked["stream"]["state"], checked["stream"]["index"])
        if anchor.index > consumed:
            raise ValueError(f"stream loader state: chunk index {anchor.index} is past the {consumed} items consumed; "
                             "the state is corrupt")
        self.epoch = checked["epoch"]
        self.batches_seen = checked["batches_seen"] if checked["world_size"] == self.view.world else 0
        # The saved run's last round may have been padded with repeats: up to world_size - 1 of the consumed
        # items were not new ones.
        self._new_split(anchor, consumed, padding=checked["world_size"] - 1)
        self._resume, self._started = True, True


def rebuild_loader(loader: DataLoader, rank: int, world_size: int, seed: int, device: torch.device,
                   all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> RunnerDataLoader:
    """``loader`` rebuilt for a Runner: a :class:`~shardkit.data.sharded_loader.ShardedLoader` for a
    :class:`~shardkit.data.sharded_files.ShardedFiles` dataset (each rank reads only its files; ``all_gather`` is the
    Runner's, for the ranks to agree), a :class:`StreamingLoader` for another streamed dataset, else the sampler-based
    :func:`shardkit.data.loader.rebuild_dataloader` (sharded, shuffled per epoch, resumable)."""
    if isinstance(loader.dataset, ShardedFiles):
        return ShardedLoader(loader, rank, world_size, seed, device, all_gather)
    if is_stream(loader.dataset):
        return StreamingLoader(loader, rank, world_size, seed, device)
    return rebuild_dataloader(loader, rank, world_size, seed, device)


def _check_stream_state(state: Any, seed: int, stream: ChunkedStream) -> dict[str, Any]:
    """A saved stream-loader state, checked field by field (every checkpoint file is hostile)."""
    ints = ("epoch", "batches_seen", "seed", "offset", "world_size", "samples_seen")
    if not isinstance(state, Mapping) or any(k not in state for k in (*ints, "stream")):
        raise ValueError(f"stream loader state must hold {ints} and 'stream': this checkpoint was not written by a "
                         "streamed loader (resume with the same kind of dataset)")
    out: dict[str, Any] = {}
    for key in ints:
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"stream loader state field {key!r} must be an integer >= 0, got {value!r:.40}")
        out[key] = value
    if out["world_size"] < 1:
        raise ValueError("stream loader state has world_size 0; it is corrupt")
    if out["seed"] != seed:
        raise ValueError(f"stream loader was saved with seed {out['seed']} but this one uses {seed}; pass the same "
                         "Runner(seed=...) to resume")
    position = state["stream"]
    if not isinstance(position, Mapping) or set(position) != {"state", "index"}:
        raise ValueError("stream loader state field 'stream' must hold 'state' and 'index'")
    index = position["index"]
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"stream loader state: stream index must be an integer >= 0, got {index!r:.40}")
    out["stream"] = {"state": stream.check_state(position["state"]), "index": index}
    return out
