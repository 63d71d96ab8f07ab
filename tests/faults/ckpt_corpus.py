"""Builders of a corpus of bad checkpoints (issue 13 A, B, C, E): each is a good checkpoint with one thing
broken, as an attacker or a failing disk would break it.

``build_corpus(root)`` writes one directory per case under ``root`` (plus an ``outside/`` directory that
the escaping cases point into) and returns ``{case name: text its CheckpointError must contain}``.
``python tests/faults/ckpt_corpus.py OUT`` materialises the corpus to look at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shardkit.checkpoint import CheckpointWriter, ShardPiece

__all__ = ["CASES", "build_corpus", "write_good"]

MANIFEST = "shardkit.json"


def write_good(path: Path) -> Path:
    """A small checkpoint holding every entry kind: tensors (tied), json, state, sharded."""
    emb = torch.arange(12.0).reshape(3, 4)
    with CheckpointWriter(path, info={"step": 1}) as w:
        w.write_tensors("model", {"emb.weight": emb, "head.weight": emb, "bias": torch.ones(4)})
        w.write_json("trainer_state", {"step": 1})
        w.write_state("optim", {"lr": 0.1, "dtype": torch.bfloat16, "arr": np.arange(3, dtype=np.int32),
                                "scalar": np.float64(2.5), "exp_avg": torch.zeros(4)})
        full = torch.arange(10.0)
        w.write_shard("shard", {"x": [ShardPiece(full[:6], (10,), flat_range=(0, 6)),
                                      ShardPiece(full[6:], (10,), flat_range=(6, 10))]})
    return path


# ---- helpers that edit a checkpoint and keep its hashes consistent (so the check under test is what trips)

def _manifest(d: Path) -> dict:
    return json.loads((d / MANIFEST).read_text())


def _put_manifest(d: Path, m: dict) -> None:
    (d / MANIFEST).write_text(json.dumps(m))


def _rehash(d: Path, name: str, file: Path | None = None) -> None:
    data = (file or d / name).read_bytes()
    m = _manifest(d)
    m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _put_manifest(d, m)


def _edit_manifest(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        m = _manifest(d)
        fn(m)
        _put_manifest(d, m)
    return build


def _edit_json_file(file: str, fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        obj = json.loads((d / file).read_text())
        obj = fn(obj) or obj
        (d / file).write_text(json.dumps(obj))
        _rehash(d, file)
    return build


def _outside_file(d: Path, rel: str) -> str:
    """Copies model.safetensors to a path outside the checkpoint; returns ``rel`` listed in the manifest."""
    target = (d / rel) if not os.path.isabs(rel) else Path(rel)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(d / "model.safetensors", target)
    return rel


def _escape_entry(rel_of: Callable[[Path], str]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        rel = _outside_file(d, rel_of(d))
        m = _manifest(d)
        m["entries"]["model"]["file"] = rel
        data = (d / rel if not os.path.isabs(rel) else Path(rel)).read_bytes()
        m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _put_manifest(d, m)
    return build


def _escape_piece(d: Path) -> None:
    idx = json.loads((d / "shard.index.json").read_text())
    src = idx["tensors"]["x"]["pieces"][0]["file"]
    rel = "../outside/evil.rank00000.safetensors"
    (d / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(d / src, d / rel)
    for p in idx["tensors"]["x"]["pieces"]:
        p["file"] = rel
    (d / "shard.index.json").write_text(json.dumps(idx))
    _rehash(d, "shard.index.json")
    m = _manifest(d)
    data = (d / rel).read_bytes()
    m["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _put_manifest(d, m)


def _symlink_out(d: Path) -> None:
    outside = d.parent / "outside" / f"{d.name}.safetensors"
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(d / "model.safetensors", outside)
    os.symlink(outside, d / "model.safetensors")  # same bytes, same hash: only the path is wrong


def _symlink_inside(d: Path) -> None:
    os.rename(d / "model.safetensors", d / "model-data.bin")
    os.symlink("model-data.bin", d / "model.safetensors")


def _fifo(d: Path) -> None:
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")  # opening it would block for ever


def _manifest_symlink(d: Path) -> None:
    outside = d.parent / "outside" / f"{d.name}.json"
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(d / MANIFEST, outside)
    os.symlink(outside, d / MANIFEST)


def _latest(text: bytes | str, extra: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    """The case is a parent directory whose ``latest`` holds ``text``; the good checkpoint sits beside it."""
    def build(d: Path) -> None:
        shutil.move(str(d), str(d.parent / f"{d.name}-ckpt"))
        d.mkdir()
        shutil.move(str(d.parent / f"{d.name}-ckpt"), str(d / "inner"))
        if extra is not None:
            extra(d)
        (d / "latest").write_bytes(text.encode() if isinstance(text, str) else text)
    return build


def _latest_symlink_dir(d: Path) -> None:
    outside = d.parent / "outside" / f"{d.name}-target"
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(d / "inner", outside)
    os.symlink(outside, d / "link")


def _flip(file: str, at: int) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        data = bytearray((d / file).read_bytes())
        data[at] ^= 0xFF
        (d / file).write_bytes(bytes(data))
    return build


def _flip_8_data_bytes(d: Path) -> None:
    data = bytearray((d / "model.safetensors").read_bytes())
    for i in range(1, 9):
        data[-4 * i] ^= 0x01  # one low mantissa bit in 8 floats: a silently wrong weight without the hash
    (d / "model.safetensors").write_bytes(bytes(data))


def _safetensors_header(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        raw = (d / "model.safetensors").read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        fn(header)
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        (d / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + n:])
        _rehash(d, "model.safetensors")
    return build


def _set(path: list, value: object) -> Callable[[dict], None]:
    def fn(obj: dict) -> None:
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return fn


def _drop(path: list) -> Callable[[dict], None]:
    def fn(obj: dict) -> None:
        for k in path[:-1]:
            obj = obj[k]
        del obj[path[-1]]
    return fn


def _raw(file: str, data: bytes, rehash: bool = False) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        (d / file).write_bytes(data)
        if rehash:
            _rehash(d, file)
    return build


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-7])


# name -> (builder, text the error must contain: the file or the field it names)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    # A: paths that leave the checkpoint
    "a_entry_file_dotdot": (_escape_entry(lambda d: "../outside/evil.safetensors"), "evil.safetensors"),
    "a_entry_file_absolute": (_escape_entry(lambda d: str(d.parent / "outside" / "abs.safetensors")),
                              "abs.safetensors"),
    "a_entry_file_subdir": (_escape_entry(lambda d: "sub/evil.safetensors"), "evil.safetensors"),
    "a_symlink_out": (_symlink_out, "model.safetensors"),
    "a_symlink_inside": (_symlink_inside, "symlink"),
    "a_manifest_symlink": (_manifest_symlink, "shardkit.json"),
    "a_index_piece_dotdot": (_escape_piece, "evil.rank00000.safetensors"),
    "a_latest_dotdot": (_latest(".."), "latest"),
    "a_latest_elsewhere": (_latest("../elsewhere/ckpt"), "latest"),
    "a_latest_absolute": (_latest("/tmp"), "latest"),
    "a_latest_hidden": (_latest(".inner"), "latest"),
    "a_latest_symlink_dir": (_latest("link", _latest_symlink_dir), "latest"),
    # B: bytes changed after the save
    "b_flip_8_data_bytes": (_flip_8_data_bytes, "sha256"),
    "b_flip_header_byte": (_flip("model.safetensors", 20), "sha256"),
    "b_flip_state_json": (_flip("optim.json", 3), "optim.json"),
    "b_flip_index_json": (_flip("shard.index.json", 5), "shard.index.json"),
    # C: malformed manifests, indexes and pointers
    "c_latest_not_utf8": (_latest(b"\xff\xfe"), "UTF-8"),
    "c_world_size_string": (_edit_manifest(_set(["world_size"], "abc")), "world_size"),
    "c_world_size_zero": (_edit_manifest(_set(["world_size"], 0)), "world_size"),
    "c_entry_is_string": (_edit_manifest(_set(["entries", "model"], "model.safetensors")), "entries.model"),
    "c_entry_no_keys": (_edit_manifest(_drop(["entries", "model", "keys"])), "entries.model.keys"),
    "c_entry_keys_not_str": (_edit_manifest(_set(["entries", "model", "keys"], [1, 2])), "entries.model.keys"),
    "c_entry_kind_unknown": (_edit_manifest(_set(["entries", "model", "kind"], "pickle")), "entries.model.kind"),
    "c_entry_no_file": (_edit_manifest(_drop(["entries", "trainer_state", "file"])), "entries.trainer_state.file"),
    "c_entry_file_unlisted": (_edit_manifest(_set(["entries", "trainer_state", "file"], "other.json")),
                              "entries.trainer_state.file"),
    "c_alias_to_missing": (_edit_manifest(_set(["entries", "model", "aliases"], {"head.weight": "nope"})),
                           "aliases"),
    "c_files_size_string": (_edit_manifest(_set(["files", "model.safetensors", "size"], "64")), "size"),
    "c_files_sha_bad": (_edit_manifest(_set(["files", "model.safetensors", "sha256"], "xyz")), "sha256"),
    "c_files_not_object": (_edit_manifest(_set(["files"], ["model.safetensors"])), "files"),
    "c_entries_missing": (_edit_manifest(_drop(["entries"])), "entries"),
    "c_info_list": (_edit_manifest(_set(["info"], [1])), "info"),
    "c_version_99": (_edit_manifest(_set(["version"], 99)), "version"),
    "c_manifest_not_json": (_raw(MANIFEST, b'{"format": "shardkit-checkpoint", "vers'), "not valid JSON"),
    "c_manifest_not_utf8": (_raw(MANIFEST, b"\xff" * 16), "not valid JSON"),
    "c_manifest_a_list": (_raw(MANIFEST, b"[1, 2]"), "shardkit.json"),
    "c_index_no_tensors": (_edit_json_file("shard.index.json", lambda o: {"t": 1}), "tensors"),
    "c_index_shape_string": (_edit_json_file("shard.index.json", _set(["tensors", "x", "shape"], "10")), "shape"),
    "c_index_dtype_unknown": (_edit_json_file("shard.index.json", _set(["tensors", "x", "dtype"], "F99")), "F99"),
    "c_index_flat_range_out": (_edit_json_file("shard.index.json",
                                               _set(["tensors", "x", "pieces", 0, "flat_range"], [0, 99])),
                               "flat_range"),
    "c_index_piece_file_unlisted": (_edit_json_file("shard.index.json",
                                                    _set(["tensors", "x", "pieces", 0, "file"], "nope.safetensors")),
                                    "pieces[0].file"),
    "c_index_not_utf8": (_raw("shard.index.json", b"\xff\xff", rehash=True), "shard.index.json"),
    # E: the state decoder
    "e_torch_dtype_load": (_edit_json_file("optim.json", lambda o: {"torch_dtype": "load"}), "torch_dtype"),
    "e_torch_dtype_getattr": (_edit_json_file("optim.json", lambda o: {"torch_dtype": "__class__"}), "torch_dtype"),
    "e_ndarray_object_dtype": (_edit_json_file("optim.json", lambda o: {"ndarray": "t0", "dtype": "|O",
                                                                        "shape": [1]}), "dtype"),
    "e_npscalar_object": (_edit_json_file("optim.json", lambda o: {"npscalar": "|O", "hex": "00" * 8}), "dtype"),
    "e_npscalar_short": (_edit_json_file("optim.json", lambda o: {"npscalar": "<f8", "hex": "00"}), "bytes"),
    "e_tensor_ref_missing": (_edit_json_file("optim.json", lambda o: {"tensor": "t99"}), "t99"),
    "e_dict_node_malformed": (_edit_json_file("optim.json", lambda o: {"dict": [1, 2]}), "optim.json"),
    "e_unknown_node": (_edit_json_file("optim.json", lambda o: {"pickle": "cos\nsystem"}), "unknown skeleton"),
    "e_nesting_json_deep": (_raw("optim.json", b"[" * 5000 + b"]" * 5000, rehash=True), "optim.json"),
    # the safetensors files themselves
    "f_truncated": (_truncate, "truncated"),
    "f_fifo": (_fifo, "not a regular file"),
    "f_missing": (lambda d: (d / "model.safetensors").unlink(), "missing"),
    "f_header_length_huge": (_raw("model.safetensors", (2**40).to_bytes(8, "little") + b"{}" + b" " * 6, True),
                             "header length"),
    "f_header_not_json": (_raw("model.safetensors", (8).to_bytes(8, "little") + b"notjson!", True), "not JSON"),
    "f_offsets_past_end": (_safetensors_header(_set(["bias", "data_offsets"], [0, 10**6])), "data_offsets"),
    "f_shape_mismatch": (_safetensors_header(_set(["bias", "shape"], [5])), "bias"),
    "f_dtype_unknown": (_safetensors_header(_set(["bias", "dtype"], "Q9")), "Q9"),
    "f_tensor_missing": (_safetensors_header(_drop(["bias"])), "bias"),
}


def build_corpus(root: Path) -> dict[str, str]:
    """Writes every case under ``root``; returns {case: text its error must contain}."""
    root.mkdir(parents=True, exist_ok=True)
    for name, (build, _) in CASES.items():
        build(write_good(root / name))
    return {name: text for name, (_, text) in CASES.items()}


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "checkpoint-corpus")
    print(f"{len(build_corpus(out))} bad checkpoints under {out}")
