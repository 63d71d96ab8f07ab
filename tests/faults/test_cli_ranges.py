"""Numbers without ranges and files that are not files, at the command line (issue 30, "the first hour").

Each probe runs ``shardkit ...`` in-process and must end with exit code 2 and one argparse-style line
naming the flag (or file): no traceback, no hang. The corpus count is printed as the other corpora's are.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shardkit import cli
from shardkit.config.accelerate import load_accelerate_config

ESTIMATE = ["estimate-memory", "--params", "7B"]
PROBES = {  # id -> (argv, what the one line must name)
    "num-gpus -4": ([*ESTIMATE, "--num-gpus", "-4"], "--num-gpus"),
    "num-gpus 0": ([*ESTIMATE, "--num-gpus", "0"], "--num-gpus"),
    "num-gpus 1e400": ([*ESTIMATE, "--num-gpus", "1e400"], "--num-gpus"),
    "num-nodes -1": ([*ESTIMATE, "--num-nodes", "-1"], "--num-nodes"),
    "batch-size -1": ([*ESTIMATE, "--batch-size", "-1", "--seq-len", "8"], "--batch-size"),
    "seq-len 0": ([*ESTIMATE, "--batch-size", "1", "--seq-len", "0"], "--seq-len"),
    "buffer factor -1": ([*ESTIMATE, "--additional-buffer-factor", "-1"], "--additional-buffer-factor"),
    "buffer factor nan": ([*ESTIMATE, "--additional-buffer-factor", "nan"], "--additional-buffer-factor"),
    "buffer factor 1e400": ([*ESTIMATE, "--additional-buffer-factor", "1e400"], "--additional-buffer-factor"),
    "params 1e400": (["estimate-memory", "--params", "1e400"], "1e400"),
    "params nan": (["estimate-memory", "--params", "nan"], "nan"),
    "params 0": (["estimate-memory", "--params", "0"], "total_params"),
    "largest > total": ([*ESTIMATE, "--largest-layer-params", "8B"], "largest_layer_params"),
    "config /dev/zero": (["estimate-memory", "--config", "/dev/zero"], "/dev/zero"),
    "launch 10**6 processes": (["launch", "--num-processes", "1000000", "--dry-run", "SCRIPT"], "--num-processes"),
}
CORPUS: list[str] = []


def _one_line_error(argv: list[str], capsys) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if "error" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_out_of_range_number_is_one_named_line(probe, capsys, tmp_path):
    argv, names = PROBES[probe]
    script = tmp_path / "train.py"
    script.write_text("")
    line = _one_line_error([str(script) if a == "SCRIPT" else a for a in argv], capsys)
    assert names in line, line
    CORPUS.append(probe)


@pytest.mark.timeout(60)
def test_config_that_is_a_fifo_or_huge_is_refused_not_read(tmp_path, capsys):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)  # nobody writes: reading it would block for ever
    assert "not a regular file" in _one_line_error(["estimate-memory", "--config", str(fifo)], capsys)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(64 * 2**20)  # sparse: 64 MiB claimed, nothing written
    assert "is at most" in _one_line_error(["estimate-memory", "--config", str(huge)], capsys)
    CORPUS.extend(["config FIFO", "config 64 MiB"])


def test_estimate_without_largest_layer_warns_instead_of_printing_zero(capsys):
    assert cli.main([*ESTIMATE]) == 0
    captured = capsys.readouterr()
    assert "largest layer 0M" not in captured.out and "largest layer unknown" in captured.out
    assert "--largest-layer-params" in captured.err
    assert re.search(r"\dGB|\d GB", captured.out) is None and "GiB" in captured.out  # one unit, labelled
    CORPUS.append("estimate without largest layer: warned")


def test_unquoted_distributed_type_no_is_accepted(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("distributed_type: NO\nnum_processes: 1\nmixed_precision: no\n")  # YAML 1.1 reads NO as false
    cfg = load_accelerate_config(path)
    assert cfg.distributed_type == "NO" and cfg.mixed_precision == "no"
    CORPUS.append("distributed_type: NO unquoted")


def test_launch_picks_up_the_file_shardkit_config_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["config", "--yes", "--distributed-type", "MULTI_CPU", "--num-processes", "2"]) == 0
    Path("train.py").write_text("")
    capsys.readouterr()
    assert cli.main(["launch", "--dry-run", "train.py"]) == 0
    captured = capsys.readouterr()
    assert "--nproc-per-node=2" in captured.out
    assert "shardkit_config.yaml" in captured.err
    assert cli.main(["launch", "--dry-run", "--num-processes", "1", "train.py"]) == 0  # a flag wins over the file
    assert "--nproc-per-node=1" in capsys.readouterr().out
    CORPUS.append("launch default config picked up")


def test_print_corpus_counts(capsys):
    with capsys.disabled():
        print(f"\ncommand-line ranges corpus: {len(CORPUS)} probes refused or handled by name")
