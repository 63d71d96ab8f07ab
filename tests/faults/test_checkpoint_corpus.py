"""Issue 13 A, B, C, E: every checkpoint of a corpus of bad ones (tests/faults/ckpt_corpus.py) gives a named
CheckpointError when it is read in full, never a bare Python error and never wrong data."""

from __future__ import annotations

import pytest
import torch
from ckpt_corpus import CASES, build_corpus, write_good
from corpus_tools import outcome, report, verdict

from shardkit.checkpoint import CheckpointError, CheckpointReader


def read_everything(path, verify=True):
    """What a load does: open, then read every entry of every kind."""
    with CheckpointReader(path, verify=verify) as r:
        out = {}
        for name, kind in r.entries().items():
            if kind == "tensors":
                out[name] = r.read_tensors(name)
            elif kind == "json":
                out[name] = r.read_json(name)
            elif kind == "state":
                out[name] = r.read_state(name)
            else:
                out[name] = dict(r.iter_full_tensors(name))
        return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, build_corpus(root)


def test_the_good_checkpoint_reads(tmp_path):
    got = read_everything(write_good(tmp_path / "good"))
    assert torch.equal(got["model"]["head.weight"], torch.arange(12.0).reshape(3, 4))
    assert got["optim"]["dtype"] is torch.bfloat16 and torch.equal(got["shard"]["x"], torch.arange(10.0))


def test_every_bad_checkpoint_gives_a_named_error(corpus, capsys):
    root, expected = corpus
    unnamed = {name: bad for name, text in expected.items()
               if (bad := verdict(outcome(lambda: read_everything(root / name)), text)) is not None}
    report(capsys, "checkpoint corpus", "bad checkpoints", len(expected), unnamed)
    assert not unnamed, unnamed


@pytest.mark.parametrize("name", ["a_entry_file_dotdot", "a_symlink_out", "a_latest_dotdot"])
def test_escapes_are_refused_with_verify_off_too(corpus, name):
    root, expected = corpus
    with pytest.raises(CheckpointError, match=expected[name].replace(".", r"\.")):
        read_everything(root / name, verify=False)


def test_corpus_covers_each_item():
    assert {n.split("_")[0] for n in CASES} == {"a", "b", "c", "e", "f"}
