"""The Accelerator's data loaders in one process: loaders that make their own batches sharded by batch as
Accelerate's ``BatchSamplerShard`` does (``split_batches``, ``even_batches``, ``drop_last``), ``even_batches=False``
for loaders dealt per sample, ``prepare_data_loader``, iterable datasets and the exact resume of each through
``state_dict``/``load_state_dict``. The same on 2 real processes: tests/accelerate/test_accelerator_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from shardkit import Accelerator
from shardkit.accelerate_compat import (
    BatchSamplerShard,
    DataLoaderConfiguration,
    SeedableRandomSampler,
    prepare_data_loader,
    set_seed,
)
from shardkit.data.loader import ResumableSampler


def _shards(n: int, size: int, world: int, drop_last: bool = False, **kwargs) -> list[list[list[int]]]:
    return [list(BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), size, drop_last), world, rank, **kwargs))
            for rank in range(world)]


def test_batches_are_dealt_whole_and_the_last_round_completed_with_the_first_samples():
    assert _shards(22, 4, 2) == [[[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]],
                                 [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 0, 1]]]
    assert _shards(7, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]
    assert _shards(3, 1, 2) == [[[0], [2]], [[1], [0]]]


def test_uneven_batches_repeat_nothing():
    assert _shards(3, 1, 2, even_batches=False) == [[[0], [2]], [[1]]]
    assert _shards(7, 2, 2, even_batches=False) == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    assert _shards(22, 4, 2, drop_last=True) == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]


def test_split_batches_gives_each_process_a_slice_of_every_batch():
    assert _shards(22, 4, 2, split_batches=True) == [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17], [20, 21]],
                                                     [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19], [0, 1]]]
    assert _shards(22, 4, 2, split_batches=True, even_batches=False)[1][-1] == [18, 19]
    with pytest.raises(ValueError, match="multiple of 2"):
        _shards(8, 3, 2, split_batches=True)


def test_a_batch_sampler_drawing_from_global_generators_draws_the_same_everywhere():
    # Each process seeds its generators differently; the epoch's batches depend on (seed, epoch) only.
    draws = []
    for process_seed in (0, 1):
        torch.manual_seed(process_seed)
        shard = BatchSamplerShard(BatchSampler(RandomSampler(range(10)), 3, False), seed=5)
        draws.append(list(shard))
    assert draws[0] == draws[1] and sorted(i for b in draws[0] for i in b) == list(range(10))
    shard.set_epoch(1)
    assert list(shard) != draws[0]


def _bucketed(n: int = 10):
    """A loader with its own batches (a length-bucketing sampler's shape): batch_sampler, batch_size None."""
    return DataLoader(list(range(n)), batch_sampler=BatchSampler(RandomSampler(range(n)), 3, False))


def test_a_loader_with_its_own_batches_is_prepared_and_resumes_exactly():
    set_seed(3)
    accelerator = Accelerator()
    loader = accelerator.prepare(_bucketed())
    assert loader.batch_sampler.batch_sampler.batch_size == 3 and len(loader) == 4
    seen, state, rest = [], None, []
    for step, batch in enumerate(loader):
        seen += batch.tolist()
        if step == 1:
            state = loader.state_dict()
        elif step > 1:
            rest.append(batch.tolist())
    assert sorted(seen) == list(range(10))
    loader.load_state_dict(state)
    assert [b.tolist() for b in loader] == rest
    with pytest.raises(ValueError, match="resume on 2 processes"):
        loader.load_state_dict({**state, "world_size": 2})


def test_a_batch_sampler_given_as_the_sampler_fetches_whole_batches():
    dataset = [{"i": i} for i in range(7)]

    class Batched(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, indices):
            return [dataset[i] for i in indices]

    loader = DataLoader(Batched(), sampler=BatchSampler(SequentialSampler(range(7)), 2, False), batch_size=None,
                        collate_fn=torch.utils.data.default_collate)
    prepared = Accelerator().prepare(loader)
    assert [b["i"].tolist() for b in prepared] == [[0, 1], [2, 3], [4, 5], [6]]


def test_even_batches_false_deals_per_sample_without_repeats():
    sampler = ResumableSampler(7, num_replicas=2, rank=1, shuffle=False, even=False)
    assert list(sampler) == [1, 3, 5] and len(sampler) == 3
    assert list(ResumableSampler(7, num_replicas=2, rank=0, shuffle=False, even=False)) == [0, 2, 4, 6]
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    loader = accelerator.prepare(DataLoader(list(range(5)), batch_size=2))
    assert loader.batch_sampler.even_batches is False
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        yield from range(self.n)


def test_an_iterable_dataset_is_streamed_with_its_end_known_and_resumes_exactly():
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = accelerator.prepare(DataLoader(_Stream(10), batch_size=4))
    ends, rest, state = [], [], None
    for step, batch in enumerate(loader):
        ends.append(accelerator.gradient_state.end_of_dataloader)
        if step == 0:
            state = loader.state_dict()
        else:
            rest.append(batch.tolist())
    assert ends == [False, False, True] and rest == [[4, 5, 6, 7], [8, 9]]
    loader.load_state_dict(state)
    assert [b.tolist() for b in loader] == rest


def test_prepare_data_loader_keeps_the_single_process_order_and_the_users_batch_sampler():
    set_seed(0)
    plain = prepare_data_loader(DataLoader(range(8), batch_size=4))
    assert [b.tolist() for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    shuffled = prepare_data_loader(DataLoader(range(8), batch_size=4, shuffle=True), data_seed=1)
    assert isinstance(shuffled.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
    assert sorted(i for b in shuffled for i in b.tolist()) == list(range(8))
    custom = BatchSampler(SequentialSampler(range(8)), 4, False)
    assert prepare_data_loader(DataLoader(range(8), batch_sampler=custom)).batch_sampler.batch_sampler is custom


def test_seedable_random_sampler_depends_on_seed_and_epoch_only():
    first = list(SeedableRandomSampler(range(6), data_seed=4))
    sampler = SeedableRandomSampler(range(6), data_seed=4)
    assert list(sampler) == first and list(sampler) != first  # the epoch advanced after a whole pass
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_a_loaders_own_generator_draws_each_epochs_order_and_resumes_exactly():
    def loader(seed: int) -> DataLoader:
        return DataLoader(list(range(10)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))

    plain = loader(42)
    expected = [[b.tolist() for b in plain] for _ in range(2)]  # what Accelerate's prepared loader gives too
    prepared = Accelerator().prepare(loader(42))
    assert [[b.tolist() for b in prepared] for _ in range(2)] == expected
    again = Accelerator().prepare(loader(42))
    batches = iter(again)
    first = next(batches).tolist()
    state = again.state_dict()
    rest = [b.tolist() for b in batches]
    resumed = Accelerator().prepare(loader(7))  # another generator state: the saved one decides the order
    resumed.load_state_dict(state)
    assert [first, *[b.tolist() for b in resumed]] == [first, *rest] == expected[0]
    with pytest.raises(ValueError, match="order_state"):
        resumed.load_state_dict({**state, "order_state": [300] * len(state["order_state"])})
    seedable = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    with pytest.raises(ValueError, match="generator"):
        seedable.prepare(loader(42)).load_state_dict(state)
