"""Issue 30: Hugging Face weights in (`load_pretrained`) under the shardkit reader's rules. A corpus of bad HF
directories (an index naming `../outside`, an absolute path, a symlinked or FIFO shard, a non-UTF-8 or non-object
index, a key mapped to the wrong shard, int64/bool data for a float parameter, fp16 for a bf16 model) each gives a
named CheckpointError and leaves the model as it was; fp32 <-> 16-bit loads are cast."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from corpus_tools import outcome, report, verdict
from safetensors.torch import save_file
from torch import nn

from shardkit import Runner
from shardkit.checkpoint import CheckpointError
from shardkit.checkpoint.hf import load_pretrained

INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3).to(dtype)
        self.norm = nn.LayerNorm(3).to(dtype)
        self.register_buffer("count", torch.tensor([3, 4], dtype=torch.int64))


def _weights(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"proj.weight": torch.randn(3, 4, generator=g).to(dtype), "proj.bias": torch.randn(3, generator=g).to(dtype),
            "norm.weight": torch.randn(3, generator=g).to(dtype), "norm.bias": torch.randn(3, generator=g).to(dtype),
            "count": torch.tensor([9, 9], dtype=torch.int64)}


def write_sharded(d: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """An HF directory: two shards and an index (proj.* in the first, the rest in the second)."""
    tensors = _weights() if tensors is None else tensors
    d.mkdir(parents=True)
    parts = ({k: v for k, v in tensors.items() if k.startswith("proj")},
             {k: v for k, v in tensors.items() if not k.startswith("proj")})
    for name, part in zip(SHARDS, parts):
        save_file(part, str(d / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, part in zip(SHARDS, parts) for k in part}}
    (d / INDEX).write_text(json.dumps(index))
    return d


def _index(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        idx = json.loads((d / INDEX).read_text())
        idx = fn(idx) or idx
        (d / INDEX).write_text(json.dumps(idx))
    return build


def _outside_shard(rel_of: Callable[[Path], str]) -> Callable[[Path], None]:
    """The first shard moved out of the directory; the index names it there (the bytes are the good ones)."""
    def build(d: Path) -> None:
        outside = d.parent / "outside" / d.name / "evil.safetensors"
        outside.parent.mkdir(parents=True)
        shutil.move(d / SHARDS[0], outside)
        rel = rel_of(outside)
        _index(lambda i: i["weight_map"].update({k: rel for k, v in i["weight_map"].items() if v == SHARDS[0]}))(d)
    return build


def _symlinked_shard(d: Path) -> None:
    outside = d.parent / "outside" / f"{d.name}.safetensors"
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(d / SHARDS[0], outside)
    os.symlink(outside, d / SHARDS[0])


def _single_symlink(d: Path) -> None:
    save_file(_weights(), str(d.parent / f"{d.name}-real.safetensors"))
    for f in d.iterdir():
        f.unlink()
    os.symlink(d.parent / f"{d.name}-real.safetensors", d / "model.safetensors")


def _fifo_shard(d: Path) -> None:
    (d / SHARDS[1]).unlink()
    os.mkfifo(d / SHARDS[1])


def _stored(key: str, value: torch.Tensor) -> Callable[[Path], None]:
    """Rewrites the shard holding ``key`` with ``value`` in its place."""
    def build(d: Path) -> None:
        shard = SHARDS[0] if key.startswith("proj") else SHARDS[1]
        from safetensors.torch import load_file

        part = load_file(str(d / shard))
        part[key] = value
        save_file(part, str(d / shard))
    return build


def _raw_index(data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / INDEX).write_bytes(data)


def _header_garbage(d: Path) -> None:
    (d / SHARDS[1]).write_bytes((2**40).to_bytes(8, "little") + b"{}      ")


# name -> (builder, text the CheckpointError must contain)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "index_dotdot": (_outside_shard(lambda p: f"../outside/{p.parent.name}/evil.safetensors"), "not a plain file name"),
    "index_absolute": (_outside_shard(str), "not a plain file name"),
    "index_subdir": (_index(lambda i: i["weight_map"].update({"proj.bias": f"sub/{SHARDS[0]}"})),
                     "weight_map.proj.bias"),
    "shard_symlink_out": (_symlinked_shard, "symlink"),
    "single_file_symlink": (_single_symlink, "symlink"),
    "shard_fifo": (_fifo_shard, "not a regular file"),
    "index_not_utf8": (_raw_index(b'{"weight_map": {"\xff": 1}}'), "not UTF-8"),
    "index_not_json": (_raw_index(b'{"weight_map": '), "not valid JSON"),
    "index_a_list": (_raw_index(b"[1, 2]"), "(the whole file)"),
    "index_no_weight_map": (_raw_index(b'{"metadata": {}}'), "weight_map"),
    "index_value_int": (_index(lambda i: i["weight_map"].update({"proj.bias": 1})), "weight_map.proj.bias"),
    "index_value_list": (_index(lambda i: i["weight_map"].update({"proj.bias": [SHARDS[0]]})), "weight_map.proj.bias"),
    "key_in_wrong_shard": (_index(lambda i: i["weight_map"].update({"proj.bias": SHARDS[1]})), "wrong shard"),
    "int64_into_fp32": (_stored("proj.weight", torch.arange(12).reshape(3, 4)), "stored as torch.int64"),
    "bool_into_fp32": (_stored("norm.weight", torch.ones(3, dtype=torch.bool)), "stored as torch.bool"),
    "fp64_into_fp32": (_stored("norm.bias", torch.ones(3, dtype=torch.float64)), "stored as torch.float64"),
    "float_into_int_buffer": (_stored("count", torch.ones(2)), "stored as torch.float32"),
    "shape_mismatch": (_stored("proj.weight", torch.zeros(4, 3)), "shape"),
    "shard_header_garbage": (_header_garbage, "not a readable safetensors file"),
}


def _load(path: Path, model: nn.Module) -> object:
    """load_pretrained's error (None: none), or "blocked" when it did not return within 20 s."""
    return outcome(lambda: load_pretrained(Runner(seed=0), model, path), timeout=20, fifos=path)


def test_a_good_sharded_directory_loads(tmp_path):
    model = Tiny()
    assert _load(write_sharded(tmp_path / "hf"), model) is None
    want = _weights()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_every_bad_directory_gives_a_named_error_and_loads_nothing(tmp_path, capsys):
    failures = {}
    for name, (build, text) in CASES.items():
        d = write_sharded(tmp_path / name)
        build(d)
        model = Tiny()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        bad = verdict(_load(d, model), text)
        if bad is None and any(not torch.equal(v, before[k]) for k, v in model.state_dict().items()):
            bad = "refused, but the model was changed before the refusal"
        if bad is not None:
            failures[name] = bad
    report(capsys, "HF weights-in corpus", "bad directories", len(CASES), failures)
    assert not failures, failures


@pytest.mark.parametrize("stored,model_dtype,ok", [
    (torch.float32, torch.bfloat16, True), (torch.bfloat16, torch.float32, True),
    (torch.float16, torch.float32, True), (torch.float32, torch.float16, True),
    (torch.float16, torch.bfloat16, False), (torch.bfloat16, torch.float16, False),
])
def test_only_fp32_and_16_bit_casts(tmp_path, stored, model_dtype, ok):
    want = _weights(stored)
    d = write_sharded(tmp_path / "hf", want)
    model = Tiny(model_dtype)
    got = _load(d, model)
    if ok:
        assert got is None
        assert torch.equal(model.proj.weight, want["proj.weight"].to(model_dtype))
    else:
        assert isinstance(got, CheckpointError) and "only casts between float32 and float16/bfloat16" in str(got)
