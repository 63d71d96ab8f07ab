"""ShardedFiles: files split by file over ranks x DataLoader workers, each opened by one reader, every sample once
per epoch, and a mid-epoch resume at another world size that continues exactly. Ranks are threads here (the loader's
collectives go through an all_gather callable; a thread barrier stands in for the process group)."""

import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import uuid

import pytest
import torch
from torch.utils.data import DataLoader

fsspec = pytest.importorskip("fsspec")
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

from shardkit.data.sharded_files import ShardedFiles, deal_units  # noqa: E402
from shardkit.data.sharded_loader import ShardedLoader  # noqa: E402

CPU = torch.device("cpu")


class CountingMemoryFS(MemoryFileSystem):
    """fsspec's memory filesystem that logs every open for reading (pid and path) to a file: a DataLoader worker is
    a forked process, so the log is how the test sees its opens."""

    protocol = "countmem"
    log_path: str | None = None

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("countmem://"))

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode and CountingMemoryFS.log_path is not None:
            with open(CountingMemoryFS.log_path, "a") as log:
                log.write(f"{os.getpid()} {self._strip_protocol(path)}\n")
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("countmem", CountingMemoryFS, clobber=True)


def _write_jsonl(root: str, files: int = 10) -> list[int]:
    fs = fsspec.filesystem("countmem")
    ids = []
    for f in range(files):
        rows = [f * 100 + j for j in range(5 + f % 4)]  # uneven files
        ids += rows
        fs.pipe(f"{root}/part-{f:02d}.jsonl", b"".join(json.dumps({"id": i}).encode() + b"\n" for i in rows))
    return sorted(ids)


@pytest.fixture
def data(tmp_path):
    root = f"/sharded-{uuid.uuid4().hex[:8]}"
    ids = _write_jsonl(root)
    CountingMemoryFS.log_path = str(tmp_path / "opens.log")
    yield f"countmem://{root}", ids, tmp_path / "opens.log"
    CountingMemoryFS.log_path = None
    fsspec.filesystem("countmem").rm(root, recursive=True)


class ThreadGroup:
    """all_gather over threads: each rank's tensor, stacked in rank order, as ``Runner.all_gather`` returns."""

    def __init__(self, world: int):
        self.barrier, self.slots = threading.Barrier(world, timeout=120), [None] * world

    def for_rank(self, rank: int):
        def all_gather(tensor):
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            out = torch.stack(self.slots)
            self.barrier.wait()
            return out
        return all_gather


def _on_ranks(world: int, fn):
    group, results, errors = ThreadGroup(world), [None] * world, []

    def run(rank):
        try:
            results[rank] = fn(rank, group.for_rank(rank))
        except BaseException as err:  # reported below; the barrier's timeout ends the other ranks
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def _loader(url, rank, world, gather, workers=0, batch_size=3, **kwargs):
    files = ShardedFiles(f"{url}/*.jsonl", **kwargs)
    return ShardedLoader(DataLoader(files, batch_size=batch_size, num_workers=workers), rank, world, 0, CPU, gather)


def _take(loader, steps=None):
    """The real (not repeated) sample ids of ``steps`` batches (None: the rest of the epoch), and the steps run."""
    ids, count = [], 0
    for batch in loader:
        if not loader.repeated:
            ids += batch["id"].tolist()
        count += 1
        if steps is not None and count == steps:
            break
    return ids, count


def _this_test() -> str:
    return "test_two_ranks_two_workers_open_each_file_once_and_serve_each_sample_once"


def test_two_ranks_two_workers_open_each_file_once_and_serve_each_sample_once(data):
    # Its DataLoader workers are forked (the memory filesystem that counts the opens lives in this process). A
    # process that earlier tests filled with thread pools (OpenMP, Arrow) can hand a forked child a broken one, and
    # the worker segfaults: the test runs in a fresh interpreter unless it is that interpreter.
    if os.environ.get("SHARDKIT_TEST_FRESH_INTERPRETER") != "1":
        done = subprocess.run([sys.executable, "-m", "pytest", f"{__file__}::{_this_test()}", "-q", "-p",
                               "no:cacheprovider"], env={**os.environ, "SHARDKIT_TEST_FRESH_INTERPRETER": "1"},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        return
    url, ids, log = data
    results = _on_ranks(2, lambda rank, gather: _take(_loader(url, rank, 2, gather, workers=2)))
    seen = results[0][0] + results[1][0]
    assert sorted(seen) == ids  # every sample once: none lost, none repeated
    assert results[0][1] == results[1][1]  # the ranks stepped together
    opens = [line.split() for line in log.read_text().splitlines()]
    paths = [p for _, p in opens]
    assert len(paths) == 10 and len(set(paths)) == 10  # each file opened exactly once, by one reader
    assert len({pid for pid, _ in opens}) == 4  # by the 4 readers (2 ranks x 2 worker processes)


def test_deal_gives_each_rank_its_files_and_each_worker_its_part():
    readers = deal_units(list(range(10)), 2, 2)
    assert readers == [[0, 4, 8], [2, 6], [1, 5, 9], [3, 7]]
    assert sorted(u for r in readers for u in r) == list(range(10))


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_world_size_continues_exactly(data, before, after):
    url, ids, _ = data
    kwargs = dict(shuffle=True, shuffle_buffer=4)

    def first(rank, gather):
        loader = _loader(url, rank, before, gather, **kwargs)
        seen, _ = _take(loader, steps=4)
        return seen, loader.state_dict()

    done = _on_ranks(before, first)
    states = [s for _, s in done]
    assert all(s == states[0] for s in states)  # every rank saves the whole epoch's position
    saved = json.loads(json.dumps(states[-1]))  # as a checkpoint holds it

    def rest(rank, gather):
        loader = _loader(url, rank, after, gather, **kwargs)
        loader.load_state_dict(saved)
        return _take(loader)[0]

    seen = [i for s, _ in done for i in s] + [i for r in _on_ranks(after, rest) for i in r]
    assert sorted(seen) == ids  # the union is the whole epoch, no sample twice

    # The epoch after the resumed one is whole again, in another order.
    loader = _loader(url, 0, 1, None, **kwargs)
    loader.load_state_dict(saved)
    _take(loader)
    epoch1, _ = _take(loader)
    assert sorted(epoch1) == ids


def test_shuffle_orders_files_and_samples_by_seed_and_epoch(data):
    url, ids, _ = data
    loader = _loader(url, 0, 1, None, shuffle=True, shuffle_buffer=8)
    epoch0, epoch1 = _take(loader)[0], _take(loader)[0]
    again = _take(_loader(url, 0, 1, None, shuffle=True, shuffle_buffer=8))[0]
    assert sorted(epoch0) == sorted(epoch1) == ids
    assert epoch0 == again and epoch0 != epoch1 and epoch0 != ids


def test_fewer_files_than_readers_is_named(data):
    url, _, _ = data
    files = ShardedFiles([f"{url}/part-00.jsonl", f"{url}/part-01.jsonl"])
    loader = ShardedLoader(DataLoader(files, batch_size=2, num_workers=2), 0, 1, 0, CPU)
    named = r"10 files for 12 readers \(6 ranks x 2 DataLoader workers\): some readers would have no file"
    with pytest.raises(ValueError, match=named) as err:
        _take(_loader(url, 0, 6, lambda t: torch.stack([t] * 6), workers=2))
    assert "num_workers" in str(err.value)
    assert sorted(_take(loader)[0]) == list(range(5)) + list(range(100, 106))


def test_a_listed_but_missing_file_is_named(data):
    url, _, _ = data
    files = ShardedFiles([f"{url}/part-00.jsonl", f"{url}/gone.jsonl"])
    with pytest.raises(FileNotFoundError, match="gone.jsonl is listed but missing"):
        list(files)


def test_a_resume_over_other_files_or_a_corrupt_position_is_refused(data):
    url, _, _ = data
    loader = _loader(url, 0, 1, None)
    _take(loader, steps=2)
    state = loader.state_dict()
    other = ShardedLoader(DataLoader(ShardedFiles(f"{url}/part-0[0-4].jsonl"), batch_size=3), 0, 1, 0, CPU)
    with pytest.raises(ValueError, match="saved over other files"):
        other.load_state_dict(state)
    bad = json.loads(json.dumps(state))
    bad["progress"]["0"] = [3, 0, 2, []]
    with pytest.raises(ValueError, match="past the unit"):
        _loader(url, 0, 1, None).load_state_dict(bad)
    bad["progress"]["0"] = [0, 14, -1, []]  # a byte offset into the file, no sample before it: never read as index 0
    with pytest.raises(ValueError, match="offset 14 with no sample done"):
        _loader(url, 0, 1, None).load_state_dict(bad)


def _fs():
    return fsspec.filesystem("memory")


def test_parquet_arrow_and_tar_read_from_any_position():
    pa = pytest.importorskip("pyarrow")
    import pyarrow.ipc  # noqa: F401  (pa.ipc below)
    import pyarrow.parquet as pq

    root, fs = f"/formats-{uuid.uuid4().hex[:8]}", _fs()
    table = pa.table({"id": list(range(23))})
    with fs.open(f"{root}/a.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=5)
    with fs.open(f"{root}/b.arrow", "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    with fs.open(f"{root}/c.arrow", "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table, max_chunksize=6)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i in range(7):
            for ext, payload in (("txt", f"sample {i}".encode()), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"shard/{i:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    fs.pipe(f"{root}/d.tar", buffer.getvalue())
    files = ShardedFiles(f"memory://{root}/*")
    assert files.formats == ["parquet", "arrow", "arrow", "tar"]
    for unit in range(4):
        whole = list(files.read_unit(unit))
        assert whole[-1][3] and not any(last for *_, last in whole[:-1])
        for start in (0, 6, len(whole) - 1):
            end = whole[start - 1][2] if start else 0
            assert [s for _, s, _, _ in files.read_unit(unit, start, end)] == [s for _, s, _, _ in whole[start:]]
    tar_samples = [s for _, s, _, _ in files.read_unit(3)]
    assert tar_samples[2] == {"__key__": "shard/0002", "txt": b"sample 2", "cls": b"2"}

    fs.pipe(f"{root}/bad.parquet", b"PAR1 this is not a parquet file at all PAR1")
    fs.pipe(f"{root}/bad.tar", b"\x01" * 1024)
    for name in ("bad.parquet", "bad.tar"):
        with pytest.raises(ValueError, match=f"{name}.*(corrupt|not a readable)"):
            list(ShardedFiles([f"memory://{root}/{name}"]))
    fs.rm(root, recursive=True)


def test_a_hugging_face_streaming_dataset_is_split_by_its_shards():
    datasets = pytest.importorskip("datasets")

    def rows(shards):
        for s in shards:
            yield from ({"id": s * 100 + i} for i in range(3 + s))

    stream = datasets.IterableDataset.from_generator(rows, gen_kwargs={"shards": list(range(6))})
    expected = sorted(s * 100 + i for s in range(6) for i in range(3 + s))

    def rank_reads(rank, gather):
        files = ShardedFiles.from_hf(stream)
        loader = ShardedLoader(DataLoader(files, batch_size=2), rank, 2, 0, CPU, gather)
        first, _ = _take(loader, steps=3)
        return first, loader.state_dict(), loader.view.plan[rank]

    done = _on_ranks(2, rank_reads)
    assert {u for u, *_ in done[0][2]} == {0, 2, 4} and {u for u, *_ in done[1][2]} == {1, 3, 5}
    resumed = ShardedLoader(DataLoader(ShardedFiles.from_hf(stream), batch_size=2), 0, 1, 0, CPU)
    resumed.load_state_dict(done[0][1])
    assert sorted(done[0][0] + done[1][0] + _take(resumed)[0]) == expected


def test_runner_saves_and_resumes_the_position(data, tmp_path):
    from shardkit import Runner
    from shardkit.strategies import SingleDevice

    url, ids, _ = data

    def setup():
        runner = Runner(SingleDevice("cpu"), seed=3)
        loader = runner.setup_dataloader(DataLoader(ShardedFiles(f"{url}/*.jsonl", shuffle=True, shuffle_buffer=5),
                                                    batch_size=4))
        assert isinstance(loader, ShardedLoader)
        return runner, loader

    runner, loader = setup()
    first, _ = _take(loader, steps=5)
    runner.save(tmp_path / "ckpt", {"loader": loader})
    runner, loader = setup()
    runner.load(tmp_path / "ckpt", {"loader": loader})
    assert sorted(first + _take(loader)[0]) == ids


def test_trainer_resumes_a_sharded_dataset_with_the_uninterrupted_losses(tmp_path):
    from trainer_fixtures import StopAt, logged_losses

    from shardkit.models import Llama, LlamaConfig
    from shardkit.trainer import Trainer, TrainingArguments

    root, fs = f"/trainer-{uuid.uuid4().hex[:8]}", _fs()
    g = torch.Generator().manual_seed(0)
    for f in range(4):
        rows = [{"input_ids": torch.randint(0, 64, (8,), generator=g).tolist()} for _ in range(7 + f)]
        fs.pipe(f"{root}/{f}.jsonl", b"".join(json.dumps({**r, "labels": r["input_ids"]}).encode() + b"\n"
                                              for r in rows))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         max_position=16)

    def trainer(out, *callbacks):
        torch.manual_seed(1)
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=3, learning_rate=1e-2, max_steps=8,
                                 logging_steps=1, save_strategy="steps", save_steps=5, disable_tqdm=True, seed=0,
                                 remove_unused_columns=False, report_to=[])
        data = ShardedFiles(f"memory://{root}/*.jsonl", shuffle=True)
        return Trainer(Llama(config), args, train_dataset=data, callbacks=list(callbacks))

    full = trainer(tmp_path / "full")
    full.train()
    trainer(tmp_path / "cut", StopAt(5)).train()
    resumed = trainer(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=True)
    assert isinstance(resumed.prepared.train_loader, ShardedLoader)
    assert logged_losses(resumed) == logged_losses(full)  # the history up to step 5 comes from the checkpoint
    for (name, a), b in zip(resumed.model.named_parameters(), full.model.parameters()):
        assert torch.equal(a, b), name
    fs.rm(root, recursive=True)


def test_a_resume_at_the_same_world_size_continues_with_the_same_batches(data):
    url, ids, _ = data

    def epoch(rank, gather, stop=None, state=None):
        loader = _loader(url, rank, 2, gather, shuffle=True)
        if state is not None:
            loader.load_state_dict(state)
        batches = []
        for batch in loader:
            batches.append(batch["id"].tolist())
            if len(batches) == stop:
                return batches, loader.state_dict()
        return batches, None

    full = _on_ranks(2, lambda rank, gather: epoch(rank, gather)[0])
    # At batch 6 the ranks have finished different numbers of files: a fresh deal of the unfinished ones would hand
    # a rank the other's files (the same samples in another order); the saved split keeps each rank's own.
    cut = _on_ranks(2, lambda rank, gather: epoch(rank, gather, stop=6))
    state = json.loads(json.dumps(cut[0][1]))
    assert state["split_base"] == [] and any(v[2] != v[0] for v in state["progress"].values())  # mid-file
    rest = _on_ranks(2, lambda rank, gather: epoch(rank, gather, state=state)[0])
    assert [cut[r][0] + rest[r] for r in range(2)] == full


def test_the_accelerator_prepares_it_ends_its_window_on_the_last_batch_and_resumes(data, tmp_path):
    from shardkit import Accelerator

    url, ids, _ = data

    def prepared():
        accelerator = Accelerator(cpu=True)
        return accelerator, accelerator.prepare(DataLoader(ShardedFiles(f"{url}/*.jsonl"), batch_size=4))

    accelerator, loader = prepared()
    seen, ends = [], []
    for batch in loader:
        seen += batch["id"].tolist()
        ends.append(loader.end_of_dataloader)
        if len(ends) == 5:
            accelerator.save_state(str(tmp_path / "state"))
    assert sorted(seen) == ids and ends[-1] and not any(ends[:-1])
    accelerator, loader = prepared()
    accelerator.load_state(str(tmp_path / "state"))
    assert sorted(seen[:20] + [i for batch in loader for i in batch["id"].tolist()]) == ids
