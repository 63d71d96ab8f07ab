"""split_between_processes / gather_object without a process group: the split of every rank, padding, and
the padding repeats dropped again (the gather over real ranks is in tests/distributed/test_batch_inference.py)."""

from __future__ import annotations

import pytest
import torch

from shardkit.inference import gather_object, split_between_processes, split_counts


def _shares(items, world, padding):
    out = []
    for r in range(world):
        with split_between_processes(items, apply_padding=padding, dp_rank=r, dp_size=world) as part:
            out.append(part)
    return out


def test_counts_are_contiguous_and_as_even_as_possible():
    assert split_counts(7, 3) == (3, 2, 2)
    assert split_counts(2, 4) == (1, 1, 0, 0)
    assert split_counts(0, 2) == (0, 0)
    with pytest.raises(ValueError, match="over 0 ranks"):
        split_counts(3, 0)


def test_uneven_list_without_and_with_padding():
    items = list(range(7))
    assert _shares(items, 3, False) == [[0, 1, 2], [3, 4], [5, 6]]
    assert _shares(items, 3, True) == [[0, 1, 2], [3, 4, 4], [5, 6, 6]]
    # fewer items than ranks: with padding the empty rank repeats the list's last item
    assert _shares([10, 11], 3, False) == [[10], [11], []]
    assert _shares([10, 11], 3, True) == [[10], [11], [11]]


def test_tensors_tuples_and_dicts_split_alike():
    t = torch.arange(10).view(5, 2)
    parts = _shares(t, 2, True)
    assert torch.equal(parts[0], t[:3]) and torch.equal(parts[1], torch.cat([t[3:], t[4:]]))
    assert _shares((1, 2, 3), 2, True) == [(1, 2), (3, 3)]
    d = {"ids": [1, 2, 3], "names": ["a", "b", "c"]}
    assert _shares(d, 2, False) == [{"ids": [1, 2], "names": ["a", "b"]}, {"ids": [3], "names": ["c"]}]


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="different lengths"):
        _shares({"a": [1, 2], "b": [1]}, 2, False)
    with pytest.raises(TypeError, match="not str"):
        _shares("abc", 2, False)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        with split_between_processes([1], dp_rank=2, dp_size=2):
            pass


def test_one_process_gather_inside_split_drops_the_padding():
    with split_between_processes([1, 2, 3], apply_padding=True) as mine:  # one rank: no padding needed
        assert mine == [1, 2, 3]
        assert gather_object([x * 10 for x in mine]) == [10, 20, 30]
    assert gather_object("x") == ["x"]  # a non-list becomes one entry per rank
