"""Loaders that make their own batches, sharded by batch over the processes (``accelerate.data_loader``'s meaning).

A DataLoader built with a ``batch_sampler`` (or a ``BatchSampler`` as its ``sampler``: length-bucketing samplers)
decides which samples go together, so it cannot be dealt sample by sample as the Runner's loader is. Here the
epoch's batches are drawn once, the same on every process (the batch sampler runs under random generators seeded
by (seed, epoch), and the processes compare what they drew), and process ``r`` of ``W`` takes batches
``r, r + W, ...`` (``split_batches=True``: the ``r``-th slice of every batch). With ``even_batches`` the last round
is completed with the epoch's first samples, so every process gets as many batches of the same size;
``gather_for_metrics`` drops those repeats. The position (epoch, batches seen) is saved and restored exactly.

:func:`prepare_data_loader` is Accelerate's public function: it shards any map-style loader this way (a plain
``batch_size`` loader through a ``BatchSampler``), so that gathering the processes' batches in order gives the
batches one process would have seen.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from shardkit.data.loader import RunnerDataLoader, sample_seed
from shardkit.utils.operations import move_to_device

__all__ = ["BatchSamplerShard", "BatchShardLoader", "SeedableRandomSampler", "default_data_seed", "makes_own_batches",
           "prepare_data_loader", "remember_data_seed"]


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on (seed, epoch): the same on every process and every run.

    The seed is ``data_seed`` if given, else the ``generator``'s initial seed, else torch's; the epoch advances by
    one after each complete pass (``set_epoch`` sets it).
    """

    def __init__(self, *args: Any, data_seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if data_seed is not None:
            self.initial_seed = int(data_seed)
        elif self.generator is not None:
            self.initial_seed = self.generator.initial_seed()
        else:
            self.initial_seed = torch.random.initial_seed()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


class BatchSamplerShard(BatchSampler):
    """This process's batches of ``batch_sampler``'s epoch (see the module docstring).

    Args:
        batch_sampler: the loader's batch sampler (anything that yields lists of indices and has a length).
        num_processes, process_index: the data-parallel world and this process's place in it.
        split_batches: give each process a slice of every batch (its size must divide by ``num_processes``)
            instead of whole batches in turn.
        even_batches: complete the last round with the epoch's first samples so that every process gets as many
            batches (False: the first processes get one batch more, or a last batch that is shorter).
        seed: seeds the random generators the batch sampler draws from, with the epoch.
    """

    def __init__(self, batch_sampler: Any, num_processes: int = 1, process_index: int = 0,
                 split_batches: bool = False, even_batches: bool = True, seed: int = 0) -> None:
        # NOTE: BatchSampler.__init__ is not called: it would refuse a batch sampler in place of a sampler.
        self.batch_sampler = batch_sampler
        self.num_processes, self.process_index = num_processes, process_index
        self.split_batches, self.even_batches = split_batches, even_batches
        self.seed = seed
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches and (self.batch_size is None or self.batch_size % num_processes):
            raise ValueError(f"split_batches=True splits each batch over {num_processes} processes: the batch "
                             f"sampler's batch_size ({self.batch_size}) must be a multiple of {num_processes}")
        self.epoch = 0
        self._skip = 0
        self._drawn: tuple[tuple[int, bool], Any, Any] | None = None
        self._checked: tuple[int, bool] | None = None

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, batches: int) -> None:
        """Leave out this process's first ``batches`` batches of the next pass (a resume)."""
        self._skip = batches

    def __len__(self) -> int:
        return len(self.rounds()[0])

    def __iter__(self) -> Iterator[list[Any]]:
        mine, skip, self._skip = self.rounds()[0], self._skip, 0
        if self._checked != self._drawn[0]:  # once per epoch, where every process iterates (not in len())
            _check_same_everywhere(self._drawn[1], self.num_processes)
            self._checked = self._drawn[0]
        yield from mine[skip:]

    def real(self, batch: int) -> list[list[bool]] | None:
        """For this process's batch number ``batch``: every process's flags of which samples are real (not the
        repeats that even the last round), or None when that round holds no repeat."""
        flags = self.rounds()[1]
        return flags[batch] if 0 <= batch < len(flags) else None

    def rounds(self) -> tuple[list[list[Any]], list[list[list[bool]] | None]]:
        """This process's batches of the epoch, and per batch the real-sample flags of every process's one."""
        key = (self.epoch, self.even_batches)
        if self._drawn is None or self._drawn[0] != key:
            per_process, flags = self._deal(self._draw())
            self._drawn = (key, per_process, flags)
        _, per_process, flags = self._drawn
        return per_process[self.process_index], flags

    def _draw(self) -> list[list[Any]]:
        """The epoch's batches, drawn under generators seeded by (seed, epoch): the same on every process."""
        for target in (self.batch_sampler, self.sampler):
            if callable(getattr(target, "set_epoch", None)):
                target.set_epoch(self.epoch)
        state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            seed = sample_seed(self.seed, self.epoch, 0)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.default_generator.manual_seed(seed)  # the CPU generator only: samplers draw from it
            batches = [list(batch) for batch in self.batch_sampler]
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
            torch.set_rng_state(state[2])
        return batches

    def _deal(self, batches: list[list[Any]]) -> tuple[list[list[list[Any]]], list[list[list[bool]] | None]]:
        w, size = self.num_processes, self.batch_size
        if self.split_batches:
            return self._deal_split(batches)
        full = len(batches) // w * w
        if w == 1 or self.drop_last or not self.even_batches or (len(batches) == full and (
                size is None or not batches or len(batches[-1]) == size)):
            if self.drop_last:
                batches = batches[:full]
            per = [batches[r::w] for r in range(w)]
            return per, [None] * len(per[0])
        # The last round: its batches, the short one completed and new ones made from the epoch's first samples.
        head_batches = batches[:w]
        head: list[Any] = [i for b in head_batches for i in b] if size is not None else []
        last = len(batches) // w * w if size is None or len(batches[-1]) == size else (len(batches) - 1) // w * w
        tail = batches[last:]
        real_tail = [[True] * len(b) for b in tail]
        if size is None:  # batches of any length: whole batches from the epoch's start
            cycle = 0
            while len(tail) % w:
                tail.append(list(head_batches[cycle % len(head_batches)]))
                real_tail.append([False] * len(tail[-1]))
                cycle += 1
        else:
            while len(head) < w * size:
                head += head
            cycle = 0
            while len(tail) % w or len(tail[-1]) < size:
                if len(tail[-1]) == size:
                    tail.append([])
                    real_tail.append([])
                need = size - len(tail[-1])
                tail[-1] = tail[-1] + head[cycle:cycle + need]
                real_tail[-1] = real_tail[-1] + [False] * need
                cycle += need
        batches = batches[:last] + tail
        per = [batches[r::w] for r in range(w)]
        flags: list[list[list[bool]] | None] = [None] * (last // w)
        flags += [[real_tail[k + r] for r in range(w)] for k in range(0, len(tail), w)]
        return per, flags

    def _deal_split(self, batches: list[list[Any]]) -> tuple[list[list[list[Any]]], list[list[list[bool]] | None]]:
        w, size = self.num_processes, self.batch_size
        piece = size // w
        per: list[list[list[Any]]] = [[] for _ in range(w)]
        flags: list[list[list[bool]] | None] = []
        head = list(batches[0]) if batches else []
        for batch in batches:
            real = [True] * len(batch)
            if len(batch) < size:
                if self.drop_last:
                    break
                if self.even_batches:
                    while len(head) < size:
                        head += head
                    real += [False] * (size - len(batch))
                    batch = batch + head[:size - len(batch)]
            slices = [slice(piece * r, piece * (r + 1)) for r in range(w)]
            for r, s in enumerate(slices):
                if batch[s]:
                    per[r].append(batch[s])
            flags.append([real[s] for s in slices] if not all(real) else None)
        return per, flags


def _check_same_everywhere(per_process: list[list[list[Any]]], processes: int) -> None:
    """Refuse batches that differ between processes (a batch sampler with its own, unsynchronised generator)."""
    if processes == 1 or not dist.is_available() or not dist.is_initialized():
        return
    digest = hashlib.sha256(repr(per_process).encode()).digest()[:7]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    value = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.int64, device=device)
    low, high = value.clone(), value.clone()
    dist.all_reduce(low, dist.ReduceOp.MIN)
    dist.all_reduce(high, dist.ReduceOp.MAX)
    if low.item() != high.item():
        raise RuntimeError("the batch sampler drew different batches on different processes (it draws from a "
                           "generator of its own, seeded differently per process): give every process the same "
                           "generator seed, or let it draw from torch/numpy/random, which prepare seeds by (seed, "
                           "epoch)")


_SEEDS: dict[str, int] = {}  # the seed given to shardkit.accelerate_compat.set_seed


def remember_data_seed(seed: int) -> None:
    """``set_seed(seed)`` ran: loaders prepared from now on shuffle with ``seed`` unless given a ``data_seed``."""
    _SEEDS["seed"] = seed


def default_data_seed() -> int:
    """The shuffling seed of a loader prepared without a ``data_seed``: the last ``set_seed``'s, else 0."""
    return _SEEDS.get("seed", 0)


def makes_own_batches(loader: DataLoader) -> bool:
    """The loader's batches come from a batch sampler of the user's (``batch_sampler=`` or a ``BatchSampler`` given
    as ``sampler`` with ``batch_size=None``), not from ``batch_size``."""
    return loader.batch_size is None and (loader.batch_sampler is not None or _is_batch_sampler(loader.sampler))


def _is_batch_sampler(sampler: Any) -> bool:
    return isinstance(sampler, BatchSampler) or (not isinstance(sampler, Sampler) and hasattr(sampler, "batch_size"))


class BatchShardLoader(RunnerDataLoader):
    """A loader over :class:`BatchSamplerShard`: this process's batches on its device, resumable at the same number
    of processes (what :class:`shardkit.accelerate_compat.PreparedDataLoader` wraps for such loaders)."""

    def __init__(self, loader: DataLoader, shard: BatchSamplerShard, device: torch.device) -> None:
        self.shard = shard
        common = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, timeout=loader.timeout,
                      pin_memory=loader.pin_memory and device.type == "cuda", worker_init_fn=loader.worker_init_fn,
                      generator=torch.Generator().manual_seed(shard.seed))
        if loader.num_workers > 0:
            common.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
        if loader.batch_sampler is None:  # a batch sampler given as the sampler: the dataset fetches whole batches
            batches = DataLoader(loader.dataset, sampler=shard, batch_size=None, **common)
        else:
            batches = DataLoader(loader.dataset, batch_sampler=shard, **common)
        super().__init__(batches, sampler=None, device=device)

    @property
    def batch_size(self) -> int | None:
        size = self.shard.batch_size
        return size // self.shard.num_processes if size is not None and self.shard.split_batches else size

    @property
    def batch_sampler(self) -> BatchSamplerShard:
        return self.shard

    @property
    def num_processes(self) -> int:
        return self.shard.num_processes

    def __len__(self) -> int:
        return len(self.shard)

    def set_epoch(self, epoch: int) -> None:
        if self._resume and epoch == self.epoch:
            return
        self.epoch, self.batches_seen, self._resume, self._started = epoch, 0, False, False
        self.shard.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self._resume:
            self._resume = False
            self.shard.skip(self.batches_seen)
        elif self._started:
            self.epoch += 1
            self.batches_seen = 0
        self._started = True
        self.shard.set_epoch(self.epoch)
        for batch in self.loader:
            self.batches_seen += 1
            yield move_to_device(batch, self.device, non_blocking=True)

    def duplicate_mask(self) -> torch.Tensor | None:
        """For the rank-major gather of the last batch yielded: which samples are real (None: all of them)."""
        flags = self.shard.real(self.batches_seen - 1)
        return None if flags is None else torch.tensor([f for rank in flags for f in rank], dtype=torch.bool)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_seen": self.batches_seen, "seed": self.shard.seed,
                "world_size": self.shard.num_processes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved epoch after the batches this process had seen (same number of processes)."""
        keys = ("epoch", "batches_seen", "seed", "world_size")
        if not isinstance(state, Mapping) or any(k not in state for k in keys):
            raise ValueError(f"batch-sharded loader state must hold {keys}: this checkpoint was not written by a "
                             f"loader with its own batch sampler (resume with the same kind of loader)")
        for key in keys:
            value = state[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"batch-sharded loader state field {key!r} must be an integer >= 0, got {value!r:.40}")
        if state["seed"] != self.shard.seed:
            raise ValueError(f"the loader was saved with seed {state['seed']}, this one uses {self.shard.seed}: "
                             f"resume with the same seed (set_seed / DataLoaderConfiguration(data_seed=...))")
        if state["world_size"] != self.shard.num_processes:
            raise ValueError(f"a loader with its own batch sampler was saved on {state['world_size']} processes and "
                             f"resumes on {self.shard.num_processes}: its batches are dealt whole, so resume on "
                             f"{state['world_size']} processes")
        self.epoch, self.batches_seen = state["epoch"], state["batches_seen"]
        self.shard.set_epoch(self.epoch)
        self._resume = self._started = True
        if self.batches_seen >= len(self.shard):  # saved at the very end of an epoch
            self.epoch, self.batches_seen, self._resume, self._started = self.epoch + 1, 0, False, False
            self.shard.set_epoch(self.epoch)


def shard_batches(loader: DataLoader, num_processes: int, process_index: int, device: torch.device, seed: int,
                  split_batches: bool = False, even_batches: bool = True) -> BatchShardLoader:
    """``loader`` sharded by batch (its own batch sampler, or ``batch_size`` batches over its sampler)."""
    if makes_own_batches(loader):
        batches = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    else:
        sampler = loader.sampler
        if type(sampler) is RandomSampler:  # the same order on every process, by (seed, epoch)
            sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                            num_samples=sampler._num_samples, data_seed=seed)
        batches = BatchSampler(sampler, loader.batch_size, loader.drop_last)
    shard = BatchSamplerShard(batches, num_processes, process_index, split_batches, even_batches, seed)
    return BatchShardLoader(loader, shard, device)


def prepare_data_loader(dataloader: DataLoader, device: Any = None, num_processes: int | None = None,
                        process_index: int | None = None, split_batches: bool = False, put_on_device: bool = False,
                        rng_types: Any = None, dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False, torch_device_mesh: Any = None) -> Any:
    """Accelerate's ``prepare_data_loader``: ``dataloader`` sharded by batch over the processes (see the module
    docstring); an iterable dataset is dealt item by item (the Runner's streaming loader).

    Process ``r`` takes batches ``r, r + W, ...`` of the single-process epoch (``split_batches=True``: the ``r``-th
    slice of every batch), so gathering the processes' batches in order gives the single-process batches. A
    shuffled loader shuffles by (seed, epoch) on every process: ``data_seed``, else the last
    ``shardkit.accelerate_compat.set_seed``, else 0. ``dispatch_batches=True`` gives the same batches (each process
    reads its own; the data must be the same on every process). The result has ``state_dict``/``load_state_dict``
    whatever ``use_stateful_dataloader`` says; batches always go to ``device`` (``put_on_device`` is accepted).
    """
    from shardkit.accelerate_compat.state import GradientState, PartialState
    from shardkit.accelerate_compat.wrappers import PreparedDataLoader
    from shardkit.data.streaming import StreamingLoader, is_stream

    for name, value in (("slice_fn_for_dispatch", slice_fn_for_dispatch), ("torch_device_mesh", torch_device_mesh)):
        if value is not None:
            raise NotImplementedError(f"prepare_data_loader({name}=...) is not supported by shardkit")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    device = torch.device(device) if device is not None else state.device
    seed = data_seed if data_seed is not None else default_data_seed()
    if is_stream(dataloader.dataset):
        if split_batches:
            raise NotImplementedError("prepare_data_loader(split_batches=True) over an iterable dataset: give the "
                                      "per-process batch_size instead")
        base: Any = StreamingLoader(dataloader, process_index, num_processes, seed, device)
    else:
        base = shard_batches(dataloader, num_processes, process_index, device, seed, split_batches, even_batches)
    return PreparedDataLoader(base, GradientState(), split_batches)
