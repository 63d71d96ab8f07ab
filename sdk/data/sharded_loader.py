"""The Runner's loader for a :class:`~shardkit.data.sharded_files.ShardedFiles` dataset: each rank's DataLoader
workers read only the files dealt to them, the ranks step together, and the position (per-file progress) resumes
exactly at any world size.

Ranks step together: every batch, the ranks agree (one small all-gather) on which of them still have data. A rank
whose files end first repeats its last batch until the last rank's files end, as a sampler pads the last round; the
repeats are marked for :meth:`duplicate_mask` (``gather_for_metrics`` counts each sample once) and are not counted
in the position. Balance the files' sizes to keep those repeats few.

The position is global: :meth:`state_dict` gathers every rank's progress (a collective: call it on every rank, as
``Runner.save`` does), so each rank's saved copy is the whole epoch's and a run at another world size reads any.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shardkit.data.loader import RunnerDataLoader, sample_seed
from shardkit.data.sharded_files import ShardedFiles, UnitProgress, deal_units, epoch_order
from shardkit.utils.operations import move_to_device

__all__ = ["ShardedLoader"]

_KIND = "sharded_files"
_MAX_STATE_BYTES = 64 << 20  # per-file counters and the few indices a shuffle buffer let through early

Task = tuple[int, int, int, frozenset]  # (unit, first sample, its byte offset, indices already consumed after it)


class _ReaderView(IterableDataset):
    """Inside a DataLoader worker: reader ``rank * workers + worker``'s units, through its shuffle buffer, each
    sample with ``(unit, index, end_offset, last)``."""

    def __init__(self, files: ShardedFiles, rank: int, workers: int, seed: int):
        self.files, self.rank, self.workers, self.seed = files, rank, workers, seed
        self.plan: list[list[Task]] = []
        self.epoch = 0

    def __iter__(self) -> Iterator[tuple[Any, tuple[int, int, int, bool]]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        reader = self.rank * self.workers + worker
        buffer_size = self.files.shuffle_buffer if self.files.shuffle else 0
        rng = random.Random(sample_seed(self.seed, self.epoch, reader))
        buffer: list[tuple[Any, tuple[int, int, int, bool]]] = []
        for unit, start, offset, skip in self.plan[reader]:
            for index, sample, end, last in self.files.read_unit(unit, start, offset):
                if index in skip:
                    continue
                item = (sample, (unit, index, end, last))
                if not buffer_size:
                    yield item
                elif len(buffer) < buffer_size:
                    buffer.append(item)
                else:
                    slot = rng.randrange(buffer_size)
                    yield buffer[slot]
                    buffer[slot] = item
        rng.shuffle(buffer)
        yield from buffer


class _MetaCollate:
    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: list[tuple[Any, tuple]]) -> tuple[Any, list[tuple]]:
        return self.collate_fn([s for s, _ in samples]), [m for _, m in samples]


class ShardedLoader(RunnerDataLoader):
    """Built by :meth:`shardkit.Runner.setup_dataloader` for a DataLoader over a :class:`ShardedFiles`. It has no
    length (``len()`` raises TypeError): train by steps. Each ``iter()`` is the next epoch, or the rest of a resumed
    one.

    Args:
        loader: the user's DataLoader (``batch_size``, ``num_workers``, ``collate_fn`` are kept).
        rank, world_size: this data-parallel rank and the data-parallel size.
        seed: the shuffling seed (file order and buffers, per epoch).
        device: where batches go.
        all_gather: the Runner's ``all_gather`` (``(world, *shape)`` over every rank); needed with world_size > 1.
    """

    def __init__(self, loader: DataLoader, rank: int, world_size: int, seed: int, device: torch.device,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if loader.batch_size is None:
            raise ValueError("setup_dataloader needs a DataLoader built with batch_size=... for a ShardedFiles dataset")
        if loader.drop_last:
            raise ValueError("a ShardedFiles dataset serves every sample once per epoch, and drop_last would drop each "
                             "reader's last short batch: build the DataLoader with drop_last=False")
        if world_size > 1 and all_gather is None:
            raise ValueError("a ShardedFiles loader over several ranks needs the Runner's all_gather (the ranks agree "
                             "on the epoch's end and gather the position): build it with Runner.setup_dataloader")
        self.files: ShardedFiles = loader.dataset
        self.workers = max(loader.num_workers, 1)
        self.view = _ReaderView(self.files, rank, self.workers, seed)
        kwargs: dict[str, Any] = dict(batch_size=loader.batch_size, collate_fn=_MetaCollate(loader.collate_fn),
                                      num_workers=loader.num_workers, timeout=loader.timeout,
                                      worker_init_fn=loader.worker_init_fn,
                                      pin_memory=loader.pin_memory and device.type == "cuda")
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
            kwargs["multiprocessing_context"] = loader.multiprocessing_context
        super().__init__(DataLoader(self.view, **kwargs), sampler=None, device=device)
        self.collate_fn, self.rank, self.world_size, self.seed = loader.collate_fn, rank, world_size, seed
        self.gather = all_gather
        self.progress: dict[int, UnitProgress] = {}
        self.split_base: frozenset[int] | None = None  # units finished when the current split began
        self._steps: list[tuple[int, int]] = []  # the last step's (has a batch, batch size) per rank
        self._last_batch: Any = None
        self.repeated = False  # the latest batch repeats this rank's last one (its files ended before another's)
        self.at_end = False  # the latest batch is the epoch's last step

    @property
    def dataset(self) -> ShardedFiles:
        return self.files

    def __len__(self) -> int:
        raise TypeError("a ShardedFiles dataset has no length until read: train with max_steps")

    def set_epoch(self, epoch: int) -> None:
        if self._resume and epoch == self.epoch:
            return
        self.epoch, self.batches_seen, self._resume, self._started = epoch, 0, False, False
        self.progress, self.split_base = {}, None

    def plan(self) -> list[list[Task]]:
        """Each reader's tasks for the rest of this epoch. The split deals the units in the epoch's order less those
        finished when it began (``split_base``: none for a fresh epoch; a resume at the saved world size and worker
        count keeps the saved split, so each reader continues its own files; another one starts a split over the
        unfinished files); a reader skips the units finished since."""
        order = epoch_order(self.files.num_units, self.seed, self.epoch, self.files.shuffle)
        if self.split_base is None:
            self.split_base = frozenset(u for u, p in self.progress.items() if p.finished)
        dealt = [u for u in order if u not in self.split_base]
        readers = self.world_size * self.workers
        if not self.progress and len(dealt) < readers:
            raise ValueError(f"ShardedFiles has {len(dealt)} files for {readers} readers ({self.world_size} ranks "
                             f"x {self.workers} DataLoader workers): some readers would have no file. Use fewer "
                             "workers (num_workers), or split the data into at least as many files as readers")
        tasks = []
        for units in deal_units(dealt, self.world_size, self.workers):
            mine = [(u, self.progress.get(u) or UnitProgress()) for u in units]
            tasks.append([(u, p.done, p.offset, frozenset(p.extra)) for u, p in mine if not p.finished])
        return tasks

    def __iter__(self) -> Iterator[Any]:
        if self._resume:
            self._resume = False
        elif self._started:
            self.epoch += 1
            self.batches_seen, self.progress, self.split_base = 0, {}, None
        self._started = True
        self.files.set_epoch(self.epoch)
        fresh = not self.progress
        self.view.plan, self.view.epoch = self.plan(), self.epoch
        self._last_batch = None
        batches = iter(self.loader)
        item, steps = self._next_step(batches)
        while any(has for has, _ in steps):
            if item is not None:
                batch, metas = item
                for unit, index, end, last in metas:
                    self.progress.setdefault(unit, UnitProgress()).consume(index, end, last)
                self._last_batch, self.repeated = batch, False
            else:  # this rank's files have ended, another's have not: repeat, as a sampler pads the last round
                batch = self._last_batch if self._last_batch is not None else self._padding_batch()
                self.repeated = True
            # One step is read (and agreed) ahead, so that the last one is known while it is used (``at_end``:
            # the Accelerator ends its accumulation window there); the position counts only the batches handed out.
            self._steps = steps
            item, steps = self._next_step(batches)
            self.at_end = not any(has for has, _ in steps)
            self.batches_seen += 1
            yield move_to_device(batch, self.device)
        self.at_end = False
        self._steps = []
        if fresh and not self.batches_seen:
            raise ValueError(f"the ShardedFiles dataset gave no sample in epoch {self.epoch}: its files are empty")

    def _next_step(self, batches: Iterator[Any]) -> tuple[Any, list[tuple[int, int]]]:
        item = next(batches, None)
        return item, self._agree(item is not None, len(item[1]) if item is not None else 0)

    def _padding_batch(self) -> Any:
        """A batch for a rank that has no unit left in a resumed split: the epoch's first unit's head (a repeat)."""
        first = epoch_order(self.files.num_units, self.seed, self.epoch, self.files.shuffle)[0]
        samples = [s for _, s, _, _ in itertools.islice(self.files.read_unit(first), self.loader.batch_size)]
        self._last_batch = self.collate_fn(samples)
        return self._last_batch

    def _agree(self, has: bool, size: int) -> list[tuple[int, int]]:
        """(has a batch, its size) for every data-parallel rank, in rank order."""
        if self.world_size == 1:
            return [(int(has), size)]
        mine = torch.tensor([self.rank, int(has), size], dtype=torch.int64, device=self.device)
        rows = self.gather(mine).reshape(-1, 3).tolist()
        by_rank = {r: (h, s) for r, h, s in reversed(rows)}  # model-parallel peers hold the same data
        return [by_rank[r] for r in range(self.world_size)]

    def duplicate_mask(self) -> torch.Tensor | None:
        """For the rank-major gather of the latest batch, which rows are real (False: a rank's repeated batch);
        None when no rank repeated one."""
        if not self._steps or all(has for has, _ in self._steps):
            return None
        return torch.cat([torch.full((size,), bool(has)) for has, size in self._steps])

    def state_dict(self) -> dict[str, Any]:
        """The epoch and every file's progress, gathered from all ranks (a collective: call it on every rank)."""
        progress = {str(u): p.to_json() for u, p in self.progress.items()}
        if self.world_size > 1:
            merged: dict[str, list[Any]] = {}
            for ranks_progress in self._gather_json(progress):
                for unit, value in ranks_progress.items():
                    # Only the rank reading a unit moves it; the others hold the copy the split started from.
                    if unit not in merged or value[0] + len(value[3]) > merged[unit][0] + len(merged[unit][3]):
                        merged[unit] = value
            progress = merged
        return {"kind": _KIND, "epoch": self.epoch, "batches_seen": self.batches_seen, "seed": self.seed,
                "world_size": self.world_size, "readers": self.workers, "units": self.files.num_units,
                "fingerprint": self.files.fingerprint, "progress": progress,
                "split_base": sorted(self.split_base or ())}

    def _gather_json(self, obj: Any) -> list[Any]:
        data = json.dumps(obj, separators=(",", ":")).encode()
        sizes = self.gather(torch.tensor([self.rank, len(data)], dtype=torch.int64, device=self.device))
        sizes = sizes.reshape(-1, 2).tolist()
        buffer = torch.zeros(max(n for _, n in sizes), dtype=torch.uint8)
        buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = self.gather(buffer.to(self.device)).cpu()
        out: dict[int, Any] = {}
        for (rank, n), row in zip(sizes, gathered):
            out.setdefault(rank, json.loads(bytes(row[:n].tolist())))
        return [out[r] for r in sorted(out)]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved epoch: the files not finished are dealt over this run's ranks and workers, each read
        from where it stopped (at any world size)."""
        checked = _check_state(state, self)
        self.epoch = checked["epoch"]
        self.progress = checked["progress"]
        same = checked["world_size"] == self.world_size and checked["readers"] == self.workers
        self.batches_seen = checked["batches_seen"] if same else 0
        self.split_base = checked["split_base"] if same else None
        self._resume, self._started = True, True
        if self.progress and all(p.finished for p in self.progress.values()) and \
                len(self.progress) == self.files.num_units:  # saved at the very end of an epoch
            self.epoch, self.batches_seen, self._resume, self._started = self.epoch + 1, 0, False, False
            self.progress, self.split_base = {}, None


def _check_state(state: Any, loader: ShardedLoader) -> dict[str, Any]:
    """A saved position, checked field by field (every checkpoint file is hostile input)."""
    ints = ("epoch", "batches_seen", "seed", "world_size", "readers", "units")
    if not isinstance(state, Mapping) or state.get("kind") != _KIND:
        raise ValueError("data loader state was not written by a ShardedFiles loader: resume with the same dataset")
    if len(json.dumps(state)) > _MAX_STATE_BYTES:
        raise ValueError(f"ShardedFiles loader state holds more than {_MAX_STATE_BYTES} bytes; it is not a position")
    out: dict[str, Any] = {}
    for key in ints:
        value = state.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"ShardedFiles loader state field {key!r} must be an integer >= 0, got {value!r:.40}")
        out[key] = value
    if out["world_size"] < 1 or out["readers"] < 1:
        raise ValueError("ShardedFiles loader state has no rank or no reader; it is corrupt")
    if out["seed"] != loader.seed:
        raise ValueError(f"ShardedFiles loader was saved with seed {out['seed']} but this one uses {loader.seed}; "
                         "pass the same Runner(seed=...) to resume")
    files = loader.files
    if out["units"] != files.num_units or state.get("fingerprint") != files.fingerprint:
        raise ValueError(f"ShardedFiles loader was saved over other files ({out['units']} files, fingerprint "
                         f"{state.get('fingerprint')!r:.20}; this dataset: {files.num_units}, {files.fingerprint!r}): "
                         "resume with the same file list")
    saved = state.get("progress")
    if not isinstance(saved, Mapping):
        raise ValueError("ShardedFiles loader state field 'progress' must map file numbers to progress")
    progress: dict[int, UnitProgress] = {}
    for key, value in saved.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) >= files.num_units:
            raise ValueError(f"ShardedFiles loader state: {key!r:.40} is not a file number below {files.num_units}")
        progress[int(key)] = UnitProgress.from_json(value, f"ShardedFiles loader state: progress of file {key} "
                                                           f"({files.urls[int(key)]})")
    out["progress"] = progress
    base = state.get("split_base", [])
    if not isinstance(base, list) or any(not isinstance(u, int) or isinstance(u, bool) or u not in progress
                                         or not progress[u].finished for u in base):
        raise ValueError("ShardedFiles loader state field 'split_base' must list finished file numbers")
    out["split_base"] = frozenset(base)
    return out
