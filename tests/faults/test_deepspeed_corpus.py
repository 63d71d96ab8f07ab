"""Issue 30: zero-to-fp32 on hostile DeepSpeed checkpoints (tests/faults/ds_corpus.py). Every case gives a named
CheckpointError: `latest` leaving its directory, FIFO and symlinked rank files (without blocking), malformed
structure, and pickle bombs (billion laughs in a persistent id or a tensor's arguments, stride-0 views claiming
10**12 elements, an 8 GB expand, a 1 GiB DEFLATE pickle, keys that hash for hours, views reusing one storage),
the bombs in a subprocess under RLIMIT_AS / RLIMIT_FSIZE so a regression fails instead of taking the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from corpus_tools import outcome, report, verdict
from ds_corpus import BOMBS, CASES, GOOD, MODEL, build_case, write_good
from torch import nn

from shardkit.checkpoint import CheckpointError, consolidate_deepspeed, get_fp32_state_dict
from shardkit.checkpoint.deepspeed_reader import DeepSpeedCheckpoint
from shardkit.checkpoint.zero_to_fp32 import main

HERE = Path(__file__).parent


def _read_all(path: Path) -> None:
    with DeepSpeedCheckpoint(path) as ckpt:
        for key in ckpt.keys():
            ckpt.read(key)


def test_the_good_checkpoint_converts(tmp_path):
    write_good(tmp_path / "ck")
    sd = get_fp32_state_dict(tmp_path / "ck")
    assert set(sd) == {"w", "b", "buf"}
    assert all(torch.equal(sd[k], v) for k, v in GOOD.items()) and sd["buf"].tolist() == [7, 8]


def test_every_bad_checkpoint_gives_a_named_error(tmp_path, capsys):
    failures = {}
    for name, (_, text) in CASES.items():
        path = build_case(tmp_path, name)
        bad = verdict(outcome(lambda: _read_all(path), timeout=20, fifos=path), text)
        if bad is not None:
            failures[name] = bad
    report(capsys, "DeepSpeed corpus", "bad checkpoints", len(CASES), failures)
    assert not failures, failures


def test_pickle_bombs_are_refused_with_bounded_memory_and_time(tmp_path, capsys):
    for name in BOMBS:
        build_case(tmp_path, name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, str(HERE / "probe_bombs.py"), str(tmp_path), str(tmp_path / "out"),
                               *BOMBS], capture_output=True, text=True, timeout=120, env=env)
        stdout = proc.stdout
    except subprocess.TimeoutExpired as e:  # a bomb went off: report the cases that ended before it
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    results = {r["case"]: r for r in map(json.loads, stdout.splitlines())}
    failures = {}
    for name, (_, text) in BOMBS.items():
        r = results.get(name)
        if r is None:
            failures[name] = "did not end within the time limit"
        elif r["error"] not in ("CheckpointError", "UnsafePickleError") or text not in r["message"]:
            failures[name] = f"{r['error']}: {r['message'][:300]}"
    peak = max((r["peak_rss_mb"] for r in results.values()), default=0)
    report(capsys, "pickle-bomb corpus", "bombs", len(BOMBS), failures,
           f" (peak RSS {peak} MB, {sum(r['seconds'] for r in results.values()):.2f} s in all)")
    assert not failures, failures
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))


def test_fifo_rank_file_through_the_command_is_refused_at_once(tmp_path, capsys):
    ck = build_case(tmp_path, "optim_fifo")
    codes: list = []
    assert outcome(lambda: codes.append(main([str(ck), str(tmp_path / "out")])), timeout=20, fifos=ck) is None
    assert codes == [2]
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("tag", ["../victim/global_step1", "/etc", ".."])
def test_tag_argument_stays_in_the_directory(tmp_path, tag):
    write_good(tmp_path / "ck")
    write_good(tmp_path / "victim")
    with pytest.raises(CheckpointError, match="may only name a checkpoint directory next to it"):
        consolidate_deepspeed(tmp_path / "ck", tmp_path / "out", tag=tag)


def test_model_states_symlinked_to_another_checkpoint_is_refused_by_name(tmp_path):
    ck = build_case(tmp_path, "model_symlink")
    with pytest.raises(CheckpointError, match=f"{MODEL}: the torch.save file cannot be opened \\(it is a symlink\\)"):
        consolidate_deepspeed(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_loading_into_a_model_casts_only_between_fp32_and_16_bit(tmp_path):
    from shardkit.checkpoint import load_state_dict_from_zero_checkpoint

    write_good(tmp_path / "ck")
    model = nn.Module()
    model.w, model.b = nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(3))
    model.register_buffer("buf", torch.zeros(2, dtype=torch.int64))
    load_state_dict_from_zero_checkpoint(model, tmp_path / "ck")
    assert torch.equal(model.w, GOOD["w"].bfloat16()) and model.buf.tolist() == [7, 8]
    model.register_buffer("buf", torch.zeros(2))  # the checkpoint's int64 counts into a float buffer
    with pytest.raises(CheckpointError, match="'buf' is stored as torch.int64 but the model holds torch.float32"):
        load_state_dict_from_zero_checkpoint(model, tmp_path / "ck")
