import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from shardkit.data.loader import ResumableSampler, rebuild_dataloader


def test_sampler_shards_cover_the_dataset_once_plus_padding():
    shards = [list(ResumableSampler(10, 3, r, shuffle=True, seed=1)) for r in range(3)]
    assert all(len(s) == 4 for s in shards)
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(10)) and len(flat) == 12


def test_sampler_order_depends_only_on_seed_and_epoch():
    a, b = ResumableSampler(50, shuffle=True, seed=3), ResumableSampler(50, shuffle=True, seed=3)
    a.set_epoch(2), b.set_epoch(2)
    assert list(a) == list(b)
    b.set_epoch(3)
    assert list(a) != list(b)


def test_loader_resumes_mid_epoch_with_the_same_batches():
    data = TensorDataset(torch.arange(40))
    full = rebuild_dataloader(DataLoader(data, batch_size=4, shuffle=True), 0, 1, seed=7, device=torch.device("cpu"))
    epoch0 = [b[0].tolist() for b in full]
    epoch1 = [b[0].tolist() for b in full]
    assert epoch0 != epoch1

    part = rebuild_dataloader(DataLoader(data, batch_size=4, shuffle=True), 0, 1, seed=7, device=torch.device("cpu"))
    it = iter(part)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = part.state_dict()
    resumed = rebuild_dataloader(DataLoader(data, batch_size=4, shuffle=True), 0, 1, seed=7, device=torch.device("cpu"))
    resumed.load_state_dict(state)
    rest = [b[0].tolist() for b in resumed]
    assert seen + rest == epoch0
    assert [b[0].tolist() for b in resumed] == epoch1


def test_duplicate_mask_marks_padding_of_the_last_batch():
    data = TensorDataset(torch.arange(5))
    loaders = [rebuild_dataloader(DataLoader(data, batch_size=2), r, 2, 0, torch.device("cpu")) for r in range(2)]
    batches = [list(ld) for ld in loaders]
    last = torch.cat([batches[0][-1][0], batches[1][-1][0]])  # rank-major gather of the last batch
    mask = loaders[0].duplicate_mask()
    seen = torch.cat([batches[0][0][0], batches[1][0][0], last[mask]])
    assert sorted(seen.tolist()) == [0, 1, 2, 3, 4]


def _loader(data, rank, world, shuffle, drop_last, batch_size=2, num_workers=0, seed=5):
    dl = DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, num_workers=num_workers)
    return rebuild_dataloader(dl, rank, world, seed=seed, device=torch.device("cpu"))


def _take(loader, n):
    it, out = iter(loader), []
    for _ in range(n):
        out += next(it)[0].tolist()
    return out


@pytest.mark.parametrize("length", [24, 23])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("new_world", [1, 2, 3, 4])
def test_resume_at_another_world_size_serves_the_rest_of_the_epoch_once(new_world, shuffle, drop_last, length):
    data, batch = TensorDataset(torch.arange(length)), 2
    old = [_loader(data, r, 2, shuffle, drop_last) for r in range(2)]
    before = [i for ld in old for i in _take(ld, 3)]  # 3 of 6 batches on each of 2 ranks
    states = [ld.state_dict() for ld in old]
    assert len(set(before)) == len(before) == 12
    rest = set(range(length)) - set(before)

    new = [_loader(data, r, new_world, shuffle, drop_last) for r in range(new_world)]
    after = []
    for r, ld in enumerate(new):
        ld.load_state_dict(states[r] if r < 2 else states[0])  # the Runner's fallback for new ranks
        after += [i for b in ld for i in b[0].tolist()]
    m = len(rest)
    if new_world == 2:  # at the saving world size: exactly the uninterrupted run's batches (padding included)
        full = [[i for b in _loader(data, r, 2, shuffle, drop_last) for i in b[0].tolist()][6:] for r in range(2)]
        assert after == full[0] + full[1]
        assert set(after) >= (rest if not drop_last else set())
    elif drop_last:  # every rank gets floor(m / W) samples, then full batches only; nothing twice
        assert set(after) <= rest, "a sample served before the save was served again"
        per_rank = (m // new_world) // batch * batch
        assert len(after) == len(set(after)) == per_rank * new_world
    else:  # every remaining sample, each once, plus padding repeats (of unserved ones) to even out the ranks
        assert set(after) == rest
        assert len(after) == -(-m // new_world) * new_world
    for ld in new:  # the next epoch is a whole epoch again, over the new ranks
        assert len([i for b in ld for i in b[0].tolist()]) in {length // new_world // batch * batch,
                                                               -(-length // new_world)}


def test_resumed_state_checks_its_fields():
    ld = _loader(TensorDataset(torch.arange(8)), 0, 1, True, False)
    good = ld.state_dict()
    for bad in ({**good, "epoch": "1"}, {**good, "samples_seen": -1}, {**good, "length": 9}, {"epoch": 0}):
        with pytest.raises(ValueError, match="data loader"):
            ld.load_state_dict(bad)


class _RandomDraws(Dataset):
    """Each sample draws from torch, numpy and random, as augmentation does."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random()])


@pytest.mark.parametrize("num_workers", [1, 2])
def test_worker_randomness_resumes_exactly(num_workers):
    data = _RandomDraws()
    full = _loader(data, 0, 1, True, False, batch_size=3, num_workers=num_workers)
    epochs = [torch.cat(list(full)), torch.cat(list(full))]
    assert not torch.equal(epochs[0][:, 1:], epochs[1][:, 1:])  # fresh draws each epoch

    part = _loader(data, 0, 1, True, False, batch_size=3, num_workers=num_workers)
    it = iter(part)
    head = [next(it), next(it)]
    state = part.state_dict()
    del it
    resumed = _loader(data, 0, 1, True, False, batch_size=3, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat(head + list(resumed)), epochs[0])
    assert torch.equal(torch.cat(list(resumed)), epochs[1])
    # the draws do not depend on how many workers fetched them
    other = _loader(data, 0, 1, True, False, batch_size=3, num_workers=3 - num_workers)
    assert torch.equal(torch.cat(list(other)), epochs[0])
