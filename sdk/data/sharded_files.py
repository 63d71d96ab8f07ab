"""A dataset of many files (or a Hugging Face streaming dataset's shards), split by file across ranks and
DataLoader workers so that each reader opens only its own files.

The unit of work is a file (for ``datasets.IterableDataset``, one of its shards). An epoch's units are ordered by
(seed, epoch) when ``shuffle=True``, and the units not yet finished are dealt: rank ``r`` of ``W`` takes every
``W``-th from ``r``, and worker ``k`` of that rank's ``K`` every ``K``-th of those. Each reader reads its units in
turn through a shuffle buffer seeded by (seed, epoch, reader). Progress is kept per unit (the samples consumed, as
a prefix and the few consumed beyond it that a shuffle buffer let through early), so a run resumed at any world
size deals the unfinished units anew and each reader seeks into its units where they stopped: no sample is lost or
read twice. See :class:`shardkit.data.sharded_loader.ShardedLoader` for the loader a Runner builds over it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

from shardkit.data.file_formats import FORMATS, format_of, open_url, read_samples, require_fsspec

__all__ = ["ShardedFiles", "UnitProgress", "deal_units"]


class UnitProgress:
    """What of one unit has been consumed: every index below ``done``, plus ``extra`` beyond it (index -> the byte
    offset after it); ``offset`` is where sample ``done`` begins (0 when the format does not say); ``total`` is the
    unit's sample count once its last sample has been seen (-1 before)."""

    __slots__ = ("done", "offset", "total", "extra")

    def __init__(self, done: int = 0, offset: int = 0, total: int = -1, extra: dict[int, int] | None = None):
        self.done, self.offset, self.total, self.extra = done, offset, total, dict(extra or {})

    @property
    def consumed(self) -> int:
        return self.done + len(self.extra)

    @property
    def finished(self) -> bool:
        return self.total >= 0 and self.done >= self.total

    def consume(self, index: int, end_offset: int, last: bool) -> None:
        if last:
            self.total = index + 1
        if index < self.done or index in self.extra:
            raise RuntimeError(f"sample {index} consumed twice (a reader repeated it): this is a bug in shardkit")
        if index != self.done:
            self.extra[index] = end_offset
            return
        self.done, self.offset = index + 1, max(end_offset, 0)
        while self.done in self.extra:
            self.offset = max(self.extra.pop(self.done), 0)
            self.done += 1

    def to_json(self) -> list[Any]:
        return [self.done, self.offset, self.total, sorted(self.extra)]

    @classmethod
    def from_json(cls, value: Any, where: str) -> UnitProgress:
        """A saved unit's progress, checked (every checkpoint is hostile input)."""
        if not isinstance(value, list) or len(value) != 4:
            raise ValueError(f"{where} must be [done, offset, total, extra], got {value!r:.60}")
        done, offset, total, extra = value
        for name, v, low in (("done", done, 0), ("offset", offset, 0), ("total", total, -1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{where}: {name} must be an integer >= {low}, got {v!r:.40}")
        if not isinstance(extra, list) or any(not isinstance(i, int) or isinstance(i, bool) or i <= done
                                              for i in extra):
            raise ValueError(f"{where}: extra must be a list of sample indices after done={done}")
        if offset and not done:
            # a reader seeks to `offset` and numbers the samples from `done`: a suffix would be read as the start
            raise ValueError(f"{where}: offset {offset} with no sample done; the state is corrupt")
        if total >= 0 and (done > total or any(i >= total for i in extra)):
            raise ValueError(f"{where}: consumed samples past the unit's {total}; the state is corrupt")
        # Offsets of the extras are not saved: a resumed reader reads through them from `offset` and drops them.
        return cls(done, offset, total, dict.fromkeys(extra, -1))


def deal_units(units: Sequence[int], world_size: int, workers: int) -> list[list[int]]:
    """The units each reader takes, reader ``rank * workers + worker``: rank ``r`` every ``world_size``-th unit from
    ``r``, its worker ``k`` every ``workers``-th of those from ``k`` (so ranks differ by at most one unit)."""
    readers = []
    for rank in range(world_size):
        mine = list(units[rank::world_size])
        readers.extend(mine[k::workers] for k in range(workers))
    return readers


def epoch_order(count: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The units in epoch ``epoch``'s order: a permutation drawn from (seed, epoch), or 0..count-1."""
    if not shuffle:
        return list(range(count))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(count, generator=generator).tolist()


class ShardedFiles(IterableDataset):
    """Many files read as one dataset, split by file so that each reader opens only its own.

    Args:
        files: file URLs (``file://``, ``memory://``, ``s3://bucket/...``, plain paths), or one glob pattern
            (``"s3://bucket/train/*.parquet"``, expanded once, sorted). Listing does not open the files.
        format: ``"jsonl"``, ``"parquet"``, ``"arrow"`` or ``"tar"`` (WebDataset-style); default: each file's suffix.
        shuffle: order the files per epoch by (seed, epoch), and mix each reader's samples in a buffer.
        shuffle_buffer: samples a reader holds to mix (with ``shuffle``; 0: the files' order only).
        transform: ``f(sample) -> sample``, run in the reader (decode a tar sample's bytes, tokenize).
        storage_options: passed to fsspec (``{"anon": True}`` for a public S3 bucket; credentials as s3fs reads them).

    Iterating it directly reads every file in order (one reader); :meth:`shardkit.Runner.setup_dataloader` splits
    it over ranks and workers (:class:`~shardkit.data.sharded_loader.ShardedLoader`).
    """

    def __init__(self, files: str | Sequence[str], *, format: str | None = None, shuffle: bool = False,
                 shuffle_buffer: int = 0, transform: Callable[[Any], Any] | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        if shuffle_buffer < 0:
            raise ValueError(f"ShardedFiles: shuffle_buffer={shuffle_buffer} must be >= 0")
        if format is not None and format not in FORMATS:
            raise ValueError(f"ShardedFiles: format={format!r} is not one of {FORMATS}")
        self.storage_options = dict(storage_options or {})
        self.urls = _expand(files, self.storage_options)
        self.formats = [format or format_of(url) for url in self.urls]
        self.shuffle, self.shuffle_buffer, self.transform = shuffle, shuffle_buffer, transform
        self.hf_dataset: Any = None
        self.epoch = 0

    @classmethod
    def from_hf(cls, dataset: Any, *, shuffle: bool = False, shuffle_buffer: int = 0,
                transform: Callable[[Any], Any] | None = None) -> ShardedFiles:
        """A Hugging Face ``datasets.IterableDataset`` split by its shards (``num_shards``: its files, or its
        generator's list arguments); a reader takes its shards with ``dataset.shard(num_shards, index)``.
        Resuming inside a shard re-reads that shard's consumed part (datasets seeks no further); other shards are
        not opened."""
        count = getattr(dataset, "num_shards", None)
        if not isinstance(count, int) or not callable(getattr(dataset, "shard", None)):
            raise TypeError(f"ShardedFiles.from_hf needs a datasets.IterableDataset (num_shards, shard()), got "
                            f"{type(dataset).__name__}")
        self = cls.__new__(cls)
        IterableDataset.__init__(self)
        self.storage_options, self.hf_dataset, self.epoch = {}, dataset, 0
        self.urls = [f"shard-{i}" for i in range(count)]
        self.formats = ["hf"] * count
        self.shuffle, self.shuffle_buffer, self.transform = shuffle, shuffle_buffer, transform
        if shuffle_buffer < 0:
            raise ValueError(f"ShardedFiles: shuffle_buffer={shuffle_buffer} must be >= 0")
        return self

    @property
    def num_units(self) -> int:
        return len(self.urls)

    @property
    def fingerprint(self) -> str:
        """A digest of the units' names and formats: a checkpoint of other files is refused, not misread."""
        text = "\n".join(f"{fmt} {url}" for fmt, url in zip(self.formats, self.urls))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.hf_dataset is not None and callable(getattr(self.hf_dataset, "set_epoch", None)):
            self.hf_dataset.set_epoch(epoch)

    def read_unit(self, unit: int, start: int = 0, offset: int = 0) -> Iterator[tuple[int, Any, int, bool]]:
        """``(index, sample, end_offset, last)`` of unit ``unit`` from sample ``start`` (at byte ``offset``) on;
        ``last`` marks the unit's final sample (read one ahead). The transform is applied."""
        if self.hf_dataset is not None:
            samples = _hf_samples(self.hf_dataset, unit, self.num_units, start)
        else:
            samples = read_samples(self.urls[unit], self.formats[unit], start, offset, self.open)
        pending = next(samples, None)
        while pending is not None:
            following = next(samples, None)
            index, sample, end = pending
            yield index, (self.transform(sample) if self.transform is not None else sample), end, following is None
            pending = following

    def open(self, url: str) -> Any:
        """The file at ``url`` opened for reading (override to count or wrap the opens)."""
        return open_url(url, self.storage_options)

    def __iter__(self) -> Iterator[Any]:
        for unit in range(self.num_units):
            for _, sample, _, _ in self.read_unit(unit):
                yield sample


def _hf_samples(dataset: Any, unit: int, count: int, start: int) -> Iterator[tuple[int, Any, int]]:
    shard = dataset.shard(num_shards=count, index=unit, contiguous=True)
    for index, sample in enumerate(shard):
        if index >= start:
            yield index, sample, 0


def _expand(files: str | Sequence[str], storage_options: Mapping[str, Any]) -> list[str]:
    if isinstance(files, str):
        if not any(ch in files for ch in "*?["):
            return [files]
        fsspec = require_fsspec()
        fs, pattern = fsspec.core.url_to_fs(files, **storage_options)
        urls = sorted(fs.unstrip_protocol(p) for p in fs.glob(pattern))
        if not urls:
            raise FileNotFoundError(f"ShardedFiles: no file matches {files!r}")
        return urls
    urls = list(files)
    if not urls or any(not isinstance(u, str) or not u for u in urls):
        raise ValueError("ShardedFiles: files must be a glob or a non-empty list of URLs (strings)")
    if len(set(urls)) != len(urls):
        twice = sorted({u for u in urls if urls.count(u) > 1})
        raise ValueError(f"ShardedFiles: {twice[:3]} listed twice: every sample would be read twice per epoch")
    return urls
