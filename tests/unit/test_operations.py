"""shardkit.utils.operations: the one copy of moving a batch, sizing it, and reading "a dict or a JSON object"."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from shardkit.utils.operations import batch_size, json_object, move_to_device

Pair = namedtuple("Pair", "ids mask")


def test_move_to_device_keeps_every_container_type_and_passes_other_values():
    batch = OrderedDict(ids=torch.ones(2, 3), extra=[torch.zeros(1), "text", 3], pair=Pair(torch.ones(1), None))
    moved = move_to_device(batch, torch.device("meta"))
    assert type(moved) is OrderedDict and list(moved) == ["ids", "extra", "pair"]
    assert moved["ids"].device.type == "meta" and moved["extra"][0].device.type == "meta"
    assert moved["extra"][1:] == ["text", 3]
    assert type(moved["pair"]) is Pair and moved["pair"].ids.device.type == "meta" and moved["pair"].mask is None


def test_batch_size_reads_the_first_tensor_and_counts_anything_else_as_one():
    assert batch_size(torch.zeros(5, 2)) == 5
    assert batch_size({"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4, 7)}) == 4
    assert batch_size([(torch.zeros(3), torch.zeros(3))]) == 3
    assert batch_size(torch.tensor(1.0)) == batch_size({}) == batch_size([]) == batch_size("text") == 1


def test_json_object_takes_a_mapping_or_a_json_object_and_names_the_argument_otherwise():
    given = {"a": 1}
    assert json_object(given, "x") == given and json_object(given, "x") is not given
    assert json_object('{"use_reentrant": false}', "x") == {"use_reentrant": False}
    for bad, match in (("{oops", r"opt='\{oops' is not valid JSON .*: use a dict"),
                       ("[1, 2]", "must be a JSON object, not a JSON list"), (3, "must be a dict or a JSON object, "
                                                                                  "not int")):
        with pytest.raises(KeyError, match=match):
            json_object(bad, f"opt={bad!r}", "use a dict", error=KeyError)
