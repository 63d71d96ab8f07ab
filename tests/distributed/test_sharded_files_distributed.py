"""ShardedFiles under a real process group: 2 DDP ranks x 2 DataLoader workers read their own files (each opened by
one reader), agree through the Runner's all_gather, save one global position in a checkpoint, and a 1-rank run
resumed from it serves the rest of the epoch: every sample once."""

import json
import os

import pytest
import torch
from harness import run_distributed
from torch.utils.data import DataLoader

from shardkit import Runner
from shardkit.data import ShardedFiles
from shardkit.strategies import SingleDevice

pytest.importorskip("fsspec")


class LoggedFiles(ShardedFiles):
    """Logs each open (the pid of the reader and the URL) to a file: readers are worker processes."""

    def __init__(self, *args, log: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log

    def open(self, url):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {url}\n")
        return super().open(url)


def _first_part(root: str, ckpt: str, log: str, steps: int):
    runner = Runner("ddp", seed=5)
    files = LoggedFiles(f"file://{root}/*.jsonl", shuffle=True, shuffle_buffer=4, log=log)
    loader = runner.setup_dataloader(DataLoader(files, batch_size=3, num_workers=2))
    seen = []
    for step, batch in enumerate(loader):
        seen += [] if loader.repeated else batch["id"].tolist()
        if step + 1 == steps:
            break
    runner.save(ckpt, {"loader": loader})
    state = loader.state_dict()
    runner.teardown()
    return {"seen": seen, "state": state}


def test_two_ranks_read_their_own_files_and_a_one_rank_run_resumes_exactly(tmp_path):
    root, ids = tmp_path / "data", []
    root.mkdir()
    for f in range(10):
        rows = [f * 100 + j for j in range(5 + f % 4)]
        ids += rows
        (root / f"part-{f:02d}.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in rows))
    log = tmp_path / "opens.log"
    ranks = run_distributed(_first_part, 2, args=(str(root), str(tmp_path / "ckpt"), str(log), 5))
    assert ranks[0]["state"] == ranks[1]["state"]  # one global position, gathered through the process group
    opens = [line.split() for line in log.read_text().splitlines()]
    assert len({url for _, url in opens}) == len(opens)  # no file opened by two readers
    assert len({pid for pid, _ in opens}) == 4  # 2 ranks x 2 worker processes, each with its own files

    runner = Runner(SingleDevice("cpu"), seed=5)
    loader = runner.setup_dataloader(DataLoader(ShardedFiles(f"file://{root}/*.jsonl", shuffle=True,
                                                             shuffle_buffer=4), batch_size=3))
    runner.load(tmp_path / "ckpt", {"loader": loader})
    rest = [i for batch in loader for i in batch["id"].tolist()]
    seen = ranks[0]["seen"] + ranks[1]["seen"] + rest
    assert sorted(seen) == sorted(ids)  # the union is the epoch, nothing twice
    assert torch.equal(torch.tensor(sorted(seen)), torch.tensor(sorted(set(seen))))
