"""Sharded pieces written by 2 simulated ranks (threads with a threading.Barrier), read back any way."""

import math
import threading

import pytest
import torch

from shardkit.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter, ShardPiece
from shardkit.checkpoint.format import flat_to_boxes

FULL = {
    "w": torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7),  # odd shape: uneven splits
    "b": torch.arange(11, dtype=torch.bfloat16),
    "cube": torch.arange(3 * 4 * 5, dtype=torch.int64).reshape(3, 4, 5),
    "s": torch.tensor(4.0),
}


def _flat_pieces(rank, world):
    """ZeRO-style: each rank holds a contiguous flat range of every tensor (rank 1 gets the remainder)."""
    out = {}
    for k, t in FULL.items():
        n = t.numel()
        a, b = rank * (n // world), (n if rank == world - 1 else (rank + 1) * (n // world))
        out[k] = ShardPiece(t.reshape(-1)[a:b].clone(), global_shape=tuple(t.shape), flat_range=(a, b))
    return out


def _box_pieces(rank, world):
    """FSDP/TP-style boxes: rows split for w and cube (uneven), b split along dim 0, the scalar replicated."""
    out = {}
    for k in ("w", "cube", "b"):
        t = FULL[k]
        rows = torch.tensor_split(torch.arange(t.shape[0]), world)[rank]
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        out[k] = ShardPiece(t[lo:hi].clone(), global_shape=tuple(t.shape), offsets=(lo,) + (0,) * (t.dim() - 1))
    out["s"] = ShardPiece(FULL["s"].clone(), global_shape=(), offsets=())
    return out


def _run_ranks(world, fn):
    barrier = threading.Barrier(world, timeout=30)
    errors = []

    def target(rank):
        try:
            fn(rank, barrier.wait)
        except BaseException as e:  # surfaced in the main thread below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def _save_sharded(path, make_pieces, world=2):
    def rank_fn(rank, barrier):
        with CheckpointWriter(path, rank=rank, world_size=world, barrier=barrier, info={"w": world}) as w:
            w.write_shard("model", make_pieces(rank, world))
            if rank == 0:
                w.write_json("meta", {"ok": True})

    _run_ranks(world, rank_fn)


@pytest.mark.parametrize("make_pieces", [_flat_pieces, _box_pieces], ids=["flat", "box"])
def test_two_ranks_read_back_full_and_repartitioned(tmp_path, make_pieces):
    _save_sharded(tmp_path / "step-1", make_pieces)
    r = CheckpointReader(tmp_path, verify=True)
    assert r.world_size == 2 and r.read_json("meta") == {"ok": True}
    assert sorted(r.manifest["files"]) == ["meta.json", "model.index.json", "model.rank00000.safetensors",
                                           "model.rank00001.safetensors"]
    keys = r.sharded_keys("model")
    assert keys["w"] == ((5, 7), torch.float32) and keys["b"] == ((11,), torch.bfloat16)
    for k, t in FULL.items():
        got = r.read_full("model", k)
        assert got.dtype == t.dtype and torch.equal(got, t), k
    assert {k: v.shape for k, v in r.iter_full_tensors("model")} == {k: v.shape for k, v in FULL.items()}
    # re-read as a 3-way flat partition (resharding 2 -> 3 ranks)
    for k, t in FULL.items():
        n = t.numel()
        bounds = [0, n // 3, 2 * n // 3, n]
        parts = [r.read_flat_range("model", k, bounds[i], bounds[i + 1]) for i in range(3)]
        assert torch.equal(torch.cat(parts), t.reshape(-1)), k
    # and as boxes crossing the piece boundaries
    assert torch.equal(r.read_box("model", "w", (1, 2), (3, 4)), FULL["w"][1:4, 2:6])
    assert torch.equal(r.read_box("model", "cube", (1, 1, 1), (2, 2, 3)), FULL["cube"][1:3, 1:3, 1:4])


def _mixed_pieces(rank, world):
    """Rank 0: flat ranges [0, n//2); rank 1: boxes from the row holding element n//2 to the end.

    Together they cover each tensor, overlapping inside that row; neither covers it alone.
    """
    if rank == 0:
        return _flat_pieces(0, 2)
    out = {}
    for k, t in FULL.items():
        if t.dim() == 0:
            out[k] = ShardPiece(t.clone(), global_shape=(), offsets=())
            continue
        row = (t.numel() // 2) // math.prod(t.shape[1:])
        out[k] = ShardPiece(t[row:].clone(), global_shape=tuple(t.shape), offsets=(row,) + (0,) * (t.dim() - 1))
    return out


def test_overlapping_replicas_and_mixed_layouts(tmp_path):
    """Flat pieces on one rank, boxes on the other, overlapping: the reader takes any copy."""
    _save_sharded(tmp_path / "c", _mixed_pieces)
    r = CheckpointReader(tmp_path / "c")
    for k, t in FULL.items():
        assert torch.equal(r.read_full("model", k), t), k
        assert torch.equal(r.read_flat_range("model", k, 1, t.numel()), t.reshape(-1)[1:]), k


def test_incomplete_coverage_names_the_gap(tmp_path):
    t = FULL["w"]
    with CheckpointWriter(tmp_path / "c") as w:
        w.write_shard("model", {"w": ShardPiece(t[:2].clone(), global_shape=(5, 7), offsets=(0, 0))})
    r = CheckpointReader(tmp_path / "c")
    assert torch.equal(r.read_box("model", "w", (0, 0), (2, 7)), t[:2])
    with pytest.raises(CheckpointError, match=r"model: w.*element \(2, 0\)"):
        r.read_full("model", "w")
    with pytest.raises(CheckpointError, match="element"):
        r.read_flat_range("model", "w", 10, 20)


def test_inconsistent_global_shape_between_ranks(tmp_path):
    def pieces(rank, world):
        shape = (4,) if rank == 0 else (5,)
        return {"x": ShardPiece(torch.ones(2), global_shape=shape, flat_range=(2 * rank, 2 * rank + 2))}

    with pytest.raises(CheckpointError, match=r"x: rank 1 says global shape \[5\]"):
        _save_sharded(tmp_path / "c", pieces)
    assert not (tmp_path / "c").exists() and not (tmp_path / "latest").exists()


def test_rank_failure_aborts_everywhere(tmp_path):
    def rank_fn(rank, barrier):
        with CheckpointWriter(tmp_path / "c", rank=rank, world_size=2, barrier=barrier) as w:
            w.write_shard("model", _flat_pieces(rank, 2))
            if rank == 1:
                raise RuntimeError("rank 1 died")

    with pytest.raises((RuntimeError, CheckpointError)):
        _run_ranks(2, rank_fn)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the lock file goes when the save ends (issue 30)


def test_bad_pieces_rejected(tmp_path):
    with CheckpointWriter(tmp_path / "c") as w:
        with pytest.raises(CheckpointError, match="exceeds global_shape"):
            w.write_shard("a", {"x": ShardPiece(torch.ones(2, 2), global_shape=(3, 3), offsets=(2, 0))})
        with pytest.raises(CheckpointError, match="flat_range"):
            w.write_shard("b", {"x": ShardPiece(torch.ones(3), global_shape=(2,), flat_range=(0, 3))})
        with pytest.raises(CheckpointError, match="exactly one"):
            w.write_shard("c", {"x": ShardPiece(torch.ones(3), global_shape=(3,))})


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 5), (2, 1, 3, 2), (9,)])
def test_flat_to_boxes_covers_range_exactly(shape):
    n = math.prod(shape)
    idx = torch.arange(n).reshape(shape)
    for a in range(0, n, 3):
        for b in range(a, n + 1, 5):
            flat = []
            for off, bshape, fstart in flat_to_boxes(a, b, shape):
                box = idx[tuple(slice(o, o + s) for o, s in zip(off, bshape))].reshape(-1)
                assert torch.equal(box, torch.arange(fstart, fstart + box.numel()))
                flat.append(box)
            got = torch.cat(flat) if flat else torch.empty(0, dtype=torch.long)
            assert torch.equal(got, torch.arange(a, b)), (a, b)
