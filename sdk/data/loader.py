"""Data loading for a Runner: shard by rank, shuffle reproducibly per epoch, resume mid-epoch."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, get_worker_info

from shardkit.utils.operations import batch_size, move_to_device

__all__ = ["ResumableSampler", "RunnerDataLoader", "SeededDataset", "move_to_device", "sample_seed"]


_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """A 63-bit seed for the sample at ``position`` of epoch ``epoch``'s order (splitmix64 of the three)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) >> 1


class ResumableSampler(Sampler[int]):
    """Distributed sampler whose order depends only on (seed, epoch) and that can start mid-epoch.

    The epoch's order is a permutation of the dataset (or ``range(N)``). A *split* deals the part of it
    from ``offset`` on to the ranks: rank ``r`` of ``W`` takes positions ``offset + r, offset + r + W,
    ...``, padded by repeating the split's head so that every rank gets ``ceil(M / W)`` samples (or
    truncated to ``floor(M / W)`` with ``drop_last``), ``M = N - offset``. A fresh epoch is one split
    with ``offset = 0``. :meth:`skip` drops the first samples of this rank in the current split (a
    resume at the same world size); :meth:`resplit` starts a new split where a run at another world
    size stopped, so the remaining samples of the epoch are each served once over the new ranks.

    With ``with_seeds`` it yields ``(index, seed)`` pairs, ``seed`` a function of (seed, epoch,
    position in the epoch's order), for :class:`SeededDataset` to seed worker RNGs per sample.

    With ``even=False`` nothing is padded: rank ``r`` takes the split's positions ``r, r + W, ...`` that exist,
    so the first ``M % W`` ranks get one sample more (evaluation without repeats; the loop over the
    ranks' uneven batch counts must then tolerate it, e.g. ``Accelerator.join_uneven_inputs``).
    """

    def __init__(
        self, length: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
        drop_last: bool = False, with_seeds: bool = False, even: bool = True,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, num_replicas={num_replicas})")
        self.length = length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.with_seeds = with_seeds
        self.even = even
        # A user's RandomSampler with its own generator (a DataLoader's ``generator``, Accelerate's meaning): each
        # epoch's order is what it yields, and the generator's state before the draw is part of the position, so
        # that a resume draws the same order.
        self.order_source: RandomSampler | None = None
        self.order_state: torch.Tensor | None = None  # the generator's state before the current epoch's draw
        self._drawn: tuple[int, list[int]] | None = None  # (epoch, order) drawn from the generator
        self.epoch = 0
        self.offset = 0  # positions of the epoch's order served before the current split began
        self._skip = 0

    @property
    def split_length(self) -> int:
        """Samples of the epoch the current split deals out (before padding or dropping)."""
        return max(self.length - self.offset, 0)

    @property
    def per_rank(self) -> int:
        m, w = self.split_length, self.num_replicas
        if self.drop_last:
            return m // w
        return math.ceil(m / w) if self.even else len(range(self.rank, m, w))

    def __len__(self) -> int:
        return self.per_rank - self._skip

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (a new split at offset 0)."""
        if epoch != self.epoch:
            self.offset = 0
        self.epoch = epoch

    def skip(self, count: int) -> None:
        """Skip the first ``count`` samples of this rank in the current split (once)."""
        self._skip = count

    def resplit(self, offset: int) -> None:
        """Deal the epoch's order from ``offset`` on over this sampler's ranks (a resume at another world size)."""
        self.offset, self._skip = min(max(offset, 0), self.length), 0

    def positions(self) -> list[int]:
        """Split positions this rank yields this epoch, in order (before skipping)."""
        return [self.rank + k * self.num_replicas for k in range(self.per_rank)]

    @property
    def generator(self) -> torch.Generator | None:
        """The generator the order is drawn from (:attr:`order_source`'s), or None: the order is (seed, epoch)'s."""
        return self.order_source.generator if self.order_source is not None else None

    def draw_from(self, state: torch.Tensor | None) -> None:
        """Draw the current epoch's order from :attr:`order_source`, its generator at ``state`` (None: as it is)."""
        generator = self.generator
        if state is not None:
            generator.set_state(state)
        self.order_state = generator.get_state()
        # As a DataLoader given this generator draws from it: its iterator's worker base seed, then the sampler.
        torch.empty((), dtype=torch.int64).random_(generator=generator)
        order = [int(i) for i in self.order_source]
        if sorted(order) != list(range(self.length)):
            raise ValueError(f"the DataLoader's RandomSampler yielded {len(order)} indices, not an order of its "
                             f"{self.length} samples: give it no num_samples (or replacement) to shard it")
        self._drawn = (self.epoch, order)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle and self.generator is not None:
            if self._drawn is None or self._drawn[0] != self.epoch:
                self.draw_from(None)
            order = list(self._drawn[1])
        elif self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        split = order[self.offset:]
        total = self.per_rank * self.num_replicas if self.even or self.drop_last else len(split)
        if total > len(split):
            split += (split * math.ceil(total / max(len(split), 1)))[: total - len(split)]
        skip, self._skip = self._skip, 0
        first = self.rank + skip * self.num_replicas
        mine = split[first:total:self.num_replicas]
        if not self.with_seeds:
            return iter(mine)
        positions = range(self.offset + first, self.offset + total, self.num_replicas)
        return iter([(i, sample_seed(self.seed, self.epoch, p)) for i, p in zip(mine, positions)])


class SeededDataset(Dataset):
    """Wraps a map-style dataset for DataLoader workers: each sample is fetched right after torch, numpy
    and ``random`` are seeded from its (seed, epoch, position), so the random draws a dataset makes do
    not depend on which worker fetched it or on how many samples that worker fetched before a resume.

    In the main process (``num_workers=0``) nothing is reseeded: there the draws come from the main RNG
    streams, which a checkpoint saves and restores exactly.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        index, seed = item
        if get_worker_info() is not None:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        return self.dataset[index]


class RunnerDataLoader:
    """A DataLoader that moves batches to the device and remembers where it is in the epoch.

    Each ``iter()`` starts the next epoch (reshuffled by the sampler's seed and the epoch number)
    unless a resumed position is pending, in which case it finishes the interrupted epoch first.
    ``batches_seen`` counts the batches of the current split (the whole epoch unless the run resumed
    at another world size).
    """

    def __init__(self, loader: DataLoader, sampler: ResumableSampler, device: torch.device):
        self.loader = loader
        self.sampler = sampler
        self.device = device
        self.epoch = 0
        self.batches_seen = 0  # batches yielded in the current split
        self._resume = False
        self._started = False
        self._last_batch_start = 0  # per-rank sample index of the last yielded batch's first sample
        self._last_batch_size = 0

    @property
    def dataset(self) -> Any:
        ds = self.loader.dataset
        return ds.dataset if isinstance(ds, SeededDataset) else ds

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch``; a pending resume of that same epoch is kept."""
        if self._resume and epoch == self.epoch:
            return
        self.epoch, self.batches_seen, self._resume = epoch, 0, False
        self.sampler.resplit(0)
        self._started = False

    def __iter__(self) -> Iterator[Any]:
        if self._resume:
            self._resume = False
            self.sampler.skip(self.batches_seen * (self.loader.batch_size or 1))
        elif self._started:
            self.epoch += 1
            self.batches_seen = 0
            self.sampler.resplit(0)
        self._started = True
        self.sampler.set_epoch(self.epoch)
        start = self.batches_seen * (self.loader.batch_size or 1)
        for batch in self.loader:
            size = batch_size(batch)
            self._last_batch_start, self._last_batch_size = start, size
            start += size
            self.batches_seen += 1
            yield move_to_device(batch, self.device, non_blocking=True)

    def duplicate_mask(self) -> torch.Tensor | None:
        """For the rank-major gather of the last batch, a mask of the samples that are real (not padding).

        Returns None when the last batch holds no padding duplicates.
        """
        sampler, size = self.sampler, self._last_batch_size
        if not sampler.even or (self._last_batch_start + size) * sampler.num_replicas <= sampler.split_length:
            return None
        k = torch.arange(self._last_batch_start, self._last_batch_start + size)
        positions = k.unsqueeze(0) * sampler.num_replicas + torch.arange(sampler.num_replicas).unsqueeze(1)
        return (positions < sampler.split_length).reshape(-1)

    def state_dict(self) -> dict[str, int]:
        """Where this rank is: the epoch, the split it walks (offset, world size) and its batches in it."""
        s = self.sampler
        samples = min(self.batches_seen * (self.loader.batch_size or 1), s.per_rank)
        state = {"epoch": self.epoch, "batches_seen": self.batches_seen, "seed": s.seed, "offset": s.offset,
                 "world_size": s.num_replicas, "samples_seen": samples, "length": s.length}
        if s.generator is not None and s.order_state is not None and s._drawn is not None:
            state["order_state"] = s.order_state.tolist()
        return state

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a saved position: the next ``iter()`` resumes the saved epoch where it stopped.

        At the world size that saved it, each rank skips what it had seen (the same batches as an
        uninterrupted run). At another world size the samples of the epoch no rank had been served are
        dealt anew over the current ranks, each once.
        """
        order_state = _check_order_state(state, self.sampler)
        state = _check_state(state, self.sampler)
        self.epoch, self.batches_seen = state["epoch"], state["batches_seen"]
        self._resume, self._started = True, True
        world, offset = state.get("world_size", self.sampler.num_replicas), state.get("offset", 0)
        self.sampler.set_epoch(self.epoch)
        if order_state is not None:
            self.sampler.draw_from(order_state)
        if world == self.sampler.num_replicas:
            self.sampler.resplit(offset)
            done = self.batches_seen >= len(self.loader)
        else:  # the first offset + samples_seen * world positions of the epoch's order were served
            consumed = offset + state["samples_seen"] * world
            self.sampler.resplit(consumed)
            self.batches_seen = 0
            done = consumed >= self.sampler.length or len(self.loader) == 0
        if done:  # saved at the very end of an epoch
            self.epoch, self.batches_seen, self._resume = self.epoch + 1, 0, False
            self.sampler.resplit(0)
            self._started = False


def _check_order_state(state: Any, sampler: ResumableSampler) -> torch.Tensor | None:
    """The saved state of the user's generator before the saved epoch's draw, checked (hostile input)."""
    saved = state.get("order_state") if isinstance(state, Mapping) else None
    if sampler.generator is None:
        if saved is not None:
            raise ValueError("data loader was saved shuffling with its DataLoader's generator, this one shuffles by "
                             "(seed, epoch): resume with the same loader (a DataLoader given generator=...)")
        return None
    if saved is None:
        if isinstance(state, Mapping) and state.get("batches_seen", 0):
            raise ValueError("data loader state lacks the generator state its order was drawn from (saved by a loader "
                             "without a DataLoader generator): resume with the same loader")
        return None
    size = sampler.generator.get_state().numel()
    if not isinstance(saved, list) or len(saved) != size or any(
            not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 256 for v in saved):
        raise ValueError(f"data loader state field 'order_state' must be a list of {size} bytes (a generator state)")
    return torch.tensor(saved, dtype=torch.uint8)


def _check_state(state: Mapping[str, Any], sampler: ResumableSampler) -> dict[str, int]:
    """Validates a saved loader state (every checkpoint file is hostile): ints >= 0, the same seed/dataset."""
    need = ("epoch", "batches_seen", "seed")
    optional = ("offset", "world_size", "samples_seen", "length")
    if not isinstance(state, Mapping) or any(k not in state for k in need):
        raise ValueError(f"data loader state must hold {need}; got {state!r:.120}")
    out = {}
    for k in need + optional:
        if k in state:
            v = state[k]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"data loader state field {k!r} must be an integer >= 0, got {v!r:.40}")
            out[k] = v
    if out["seed"] != sampler.seed:
        raise ValueError(
            f"data loader was saved with shuffle seed {out['seed']} but this one uses {sampler.seed}; "
            "pass the same Runner(seed=...) to resume the same order"
        )
    if out.get("length", sampler.length) != sampler.length:
        raise ValueError(f"data loader was saved over {out['length']} samples, this dataset has {sampler.length}; "
                         "resume with the same dataset")
    if "world_size" in out and ("samples_seen" not in out or out["world_size"] < 1):
        raise ValueError("data loader state has world_size without samples_seen (or world_size 0); it is corrupt")
    return out


def rebuild_dataloader(loader: DataLoader, rank: int, world_size: int, seed: int, device: torch.device):
    """Rebuild ``loader`` with a :class:`ResumableSampler` sharding its dataset over ranks."""
    if loader.batch_sampler is not None and loader.batch_size is None:
        raise ValueError(
            "setup_dataloader needs a DataLoader built with batch_size=..., not a custom batch_sampler: "
            "sharding and resuming work per sample"
        )
    shuffle = isinstance(loader.sampler, RandomSampler)
    # Workers get per-sample seeds (see SeededDataset); without workers the main RNG state is checkpointed.
    workers = loader.num_workers > 0
    sampler = ResumableSampler(len(loader.dataset), world_size, rank, shuffle, seed, loader.drop_last, workers)
    dataset = SeededDataset(loader.dataset) if workers else loader.dataset
    kwargs = dict(
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        # NOTE: pinning asks for an accelerator and crashes on a CPU-only machine.
        pin_memory=loader.pin_memory and device.type == "cuda",
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        # NOTE: each new iterator draws a worker base seed from this generator; with the default
        # (the global RNG) that draw would shift dropout masks in a resumed run.
        generator=torch.Generator().manual_seed(seed),
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return RunnerDataLoader(DataLoader(dataset, **kwargs), sampler, device)
