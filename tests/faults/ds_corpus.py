"""Builders of bad DeepSpeed ZeRO checkpoints (issue 30): traversal, FIFOs, symlinks, bad structure and pickle
bombs, each a small good checkpoint with one thing broken.

The good checkpoint is the layout DeepSpeed 0.19 writes for ZeRO-2 on ``world`` ranks (a model-states file, one
optimizer file per rank holding its part of the flat fp32 group), made with ``torch.save`` so no DeepSpeed is
needed. Bombs are pickles crafted with :class:`TorchZip` (a minimal zip writer: a record may be DEFLATE-compressed
or declare any size). ``python tests/faults/ds_corpus.py OUT`` materialises the corpus to look at.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import shutil
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["BOMBS", "CASES", "GOOD", "build_case", "write_good"]

GOOD = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.tensor([0.5, -1.0, 2.0])}
BUFFER = torch.tensor([7, 8], dtype=torch.int64)
MODEL = "mp_rank_00_model_states.pt"


def optim_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def write_good(parent: Path, world: int = 2, tag: str = "global_step1") -> Path:
    """``parent/latest`` + ``parent/<tag>/``: a ZeRO-2 checkpoint of GOOD (trained) and BUFFER on ``world`` ranks."""
    d = parent / tag
    d.mkdir(parents=True)
    flat = torch.cat([t.reshape(-1) for t in GOOD.values()])
    flat = torch.cat([flat, flat.new_zeros(-len(flat) % (2 * world))])  # DeepSpeed pads to 2 x world size
    for r, part in enumerate(flat.chunk(world)):
        torch.save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": [world],
                                             "single_partition_of_fp32_groups": [part.clone()]},
                    "ds_version": "0.19.8"}, d / optim_name(r))
    shapes = collections.OrderedDict((k, v.shape) for k, v in GOOD.items())
    torch.save({"module": {**{k: v.half() for k, v in GOOD.items()}, "buf": BUFFER}, "buffer_names": ["buf"],
                "param_shapes": [shapes], "frozen_param_shapes": None, "shared_params": {},
                "ds_version": "0.19.8"}, d / MODEL)
    (parent / "latest").write_text(tag)
    return d


# ---- a minimal torch.save writer for crafted pickles ------------------------------------------------------------


class Storage:
    """A storage the crafted pickle refers to by persistent id: ``('storage', FloatStorage, key, 'cpu', numel)``."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class Rebuild:
    """Pickles as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""

    def __init__(self, storage: object, offset: object, size: object, stride: object) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class RawPid:
    """Pickles as a persistent id holding ``pid`` as it is."""

    def __init__(self, pid: object) -> None:
        self.pid = pid


class Items:
    """Pickles as an OrderedDict filled from ``pairs`` (SETITEMS), without building the dict here: the keys are
    the bomb, and hashing them in the test would set it off."""

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs

    def __reduce__(self):
        return collections.OrderedDict, (), None, None, iter(self.pairs)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        if isinstance(obj, RawPid):
            return obj.pid
        return None


def crafted_pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


class TorchZip:
    """Writes a zip the way torch.save lays it out (``archive/data.pkl``, ``archive/data/<key>``), record by
    record: stored, or DEFLATE-compressed with the declared size and CRC given."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "wb")
        self.central: list[bytes] = []

    def add(self, name: str, data: bytes, *, deflated: bool = False, size: int | None = None,
            crc: int | None = None) -> None:
        raw = name.encode()
        size = len(data) if size is None else size
        crc = zlib.crc32(data) if crc is None else crc
        method = 8 if deflated else 0
        offset = self.f.tell()
        fields = struct.pack("<HHHHHIII", 20, 0, method, 0, 0, crc, len(data), size)
        self.f.write(b"PK\x03\x04" + fields + struct.pack("<HH", len(raw), 0) + raw + data)
        self.central.append(b"PK\x01\x02" + struct.pack("<H", 20) + fields
                            + struct.pack("<HHHHHII", len(raw), 0, 0, 0, 0, 0, offset) + raw)

    def close(self) -> None:
        start = self.f.tell()
        for c in self.central:
            self.f.write(c)
        n = len(self.central)
        self.f.write(b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, n, n, self.f.tell() - start, start, 0))
        self.f.close()


def write_crafted(path: Path, obj: object, storages: dict[str, bytes] | None = None) -> None:
    z = TorchZip(path)
    z.add("archive/data.pkl", crafted_pickle(obj))
    z.add("archive/byteorder", b"little")
    for key, data in (storages or {}).items():
        z.add(f"archive/data/{key}", data)
    z.close()


# ---- the cases ------------------------------------------------------------------------------------------------


def _laughs(levels: int = 40) -> list:
    """A list holding the previous level twice, 40 levels deep: 80 objects, 2**40 items when printed."""
    x: list = []
    for _ in range(levels):
        x = [x, x]
    return x


def _nested_tuple(levels: int = 40) -> tuple:
    x: tuple = ()
    for _ in range(levels):
        x = (x, x)
    return x


def _model_states(d: Path, module: dict, **extra: object) -> None:
    """Rewrites the model-states file with ``module`` (crafted tensors allowed) and GOOD's shapes."""
    shapes = collections.OrderedDict((k, list(v.shape)) for k, v in GOOD.items())
    top = {"module": module, "buffer_names": list(module), "param_shapes": [shapes], "shared_params": {}, **extra}
    write_crafted(d / MODEL, top, {"0": bytes(4 << 20)})


def _latest(text: Callable[[Path], str]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        victim = write_good(d.parent.parent / f"victim-{d.parent.name}")
        (d.parent / "latest").write_text(text(victim))
    return build


def _fifo(name: str) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        (d / name).unlink()
        os.mkfifo(d / name)  # opening it for reading would block until a writer comes
    return build


def _symlink_model(d: Path) -> None:
    other = write_good(d.parent.parent / f"other-{d.parent.name}")
    (d / MODEL).unlink()
    os.symlink(other / MODEL, d / MODEL)


def _optim(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        for r in range(2):
            obj = torch.load(d / optim_name(r), weights_only=True)
            fn(obj["optimizer_state_dict"])
            torch.save(obj, d / optim_name(r))
    return build


def _model(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        obj = torch.load(d / MODEL, weights_only=True)
        fn(obj)
        torch.save(obj, d / MODEL)
    return build


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda obj: obj.__setitem__(key, value)


def _expand_buffer(d: Path) -> None:
    # 4.5 KB on disk: one float, viewed 2e9 times by stride 0; an 8 GB output if the view is believed
    _model(lambda m: m["module"].__setitem__("buf", torch.zeros(1).expand(2 * 10**9)))(d)


def _deflate_bomb(d: Path) -> None:
    """data.pkl DEFLATE-compressed: 1 MB on disk inflating to 1 GiB (each chunk restarts the compressor, so the
    1 MiB-of-zeros chunk can be repeated)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    z = TorchZip(d / MODEL)
    z.add("archive/data.pkl", chunk * 1024 + c.flush(), deflated=True, size=1 << 30, crc=0x5B64C2B0)
    z.add("archive/byteorder", b"little")
    z.close()


def _int_key_collisions(d: Path) -> None:
    # multiples of 2**61 - 1 all hash to 0: inserting 40k of them into a dict takes 8e8 comparisons
    _model_states(d, {}, junk=Items([((2**61 - 1) * (i + 1), i) for i in range(40_000)]))


def _aliasing_views(d: Path) -> None:
    # 4 MiB of storage viewed whole by 4000 buffers: each view fits its storage, together 16 GB of output
    st = Storage("0", 1 << 20)
    _model_states(d, {f"buf{i}": Rebuild(st, 0, (1 << 20,), (1,)) for i in range(4000)})


# name -> (builder, text its CheckpointError must contain). In-process cases: refused without a bomb to defuse.
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "latest_dotdot": (_latest(lambda v: f"../{v.parent.name}/{v.name}"), "latest"),
    "latest_absolute": (_latest(lambda v: str(v)), "latest"),
    "optim_fifo": (_fifo(optim_name(1)), "not a regular file"),
    "model_fifo": (_fifo(MODEL), "not a regular file"),
    "model_symlink": (_symlink_model, "symlink"),
    "partition_count_string": (_optim(_set("partition_count", "2")), "partition_count"),
    "zero_stage_string": (_optim(_set("zero_stage", "abc")), "zero_stage"),
    "groups_not_tensors": (_optim(_set("single_partition_of_fp32_groups", [[1.0, 2.0]])),
                           "single_partition_of_fp32_groups[0]"),
    "param_shapes_dict": (_model(_set("param_shapes", {"w": [3, 4]})), "param_shapes"),
    "param_shape_huge": (_model(_set("param_shapes", [{"w": [10**12], "b": [3]}])), "needs elements up to"),
    "param_shape_string": (_model(_set("param_shapes", [{"w": ["3", 4], "b": [3]}])), "param_shapes[0].w[0]"),
    "buffer_names_string": (_model(_set("buffer_names", "buf")), "buffer_names"),
    "unknown_global": (lambda d: torch.save({"x": collections.Counter()}, d / MODEL), "collections.Counter"),
}

# Pickle bombs: each is run in a subprocess under RLIMIT_AS and a time limit, so a regression fails the test
# instead of taking the machine. name -> (builder, text its CheckpointError must contain).
BOMBS: dict[str, tuple[Callable[[Path], None], str]] = {
    "pid_laughs": (lambda d: _model_states(d, {"buf": Rebuild(RawPid(("storage", _laughs(), "0", "cpu", 4)), 0,
                                                                       (1,), (1,))}), "persistent id"),
    "rebuild_size_laughs": (lambda d: _model_states(d, {"buf": Rebuild(Storage("0", 4), 0, _laughs(), (1,))}),
                            "size"),
    "rebuild_offset_laughs": (lambda d: _model_states(d, {"buf": Rebuild(Storage("0", 4), _laughs(), (1,), (1,))}),
                              "offset"),
    "stride0_1e12": (lambda d: _model_states(d, {"buf": Rebuild(Storage("0", 1), 0, (10**12,), (0,))}),
                     "views larger than their storage"),
    "expand_2e9_buffer": (_expand_buffer, "views larger than their storage"),
    "deflate_1gib_pickle": (_deflate_bomb, "a compression bomb, refused unread"),
    "tuple_key_hash": (lambda d: _model_states(d, {}, junk=Items([(_nested_tuple(), 1)])), "dict key"),
    "int_key_collisions": (_int_key_collisions, "dict key"),
    "aliasing_views": (_aliasing_views, "reuse the same bytes"),
    "partition_count_1e9": (_optim(_set("partition_count", [10**9])), "partition_count"),
    "frozen_claims_1e9": (_model(lambda m: m.update(frozen_param_shapes={"f": [10**9]},
                                                    frozen_param_fragments={"f": torch.zeros(2)})), "claims shape"),
}


def build_case(root: Path, name: str) -> Path:
    """Writes case ``name`` (of CASES or BOMBS) under ``root/name``; returns the directory holding ``latest``."""
    builder = {**CASES, **BOMBS}[name][0]
    builder(write_good(root / name))
    return root / name


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "deepspeed-corpus")
    shutil.rmtree(out, ignore_errors=True)
    for case in {**CASES, **BOMBS}:
        build_case(out, case)
    print(f"{len(CASES) + len(BOMBS)} bad DeepSpeed checkpoints under {out}")
