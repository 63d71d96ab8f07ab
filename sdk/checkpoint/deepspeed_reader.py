"""Reading DeepSpeed ZeRO checkpoints (stage 1, 2, 3; fp32/fp16/bf16 runs; any world size) without DeepSpeed.

A DeepSpeed save is a tag directory (``global_stepN/``, named by the parent's ``latest`` file) holding
``mp_rank_00_model_states.pt`` (ZeRO-1/2) or one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per
rank (ZeRO-3), and one ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank with that rank's
fp32 master partition. :class:`DeepSpeedCheckpoint` reads the files through the allowlist unpickler
(:mod:`.safe_unpickle`), works out where every parameter's pieces lie, and reads one parameter at a
time from the memory-mapped files, so the whole model is never in memory. The results equal, value
for value, DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` (frozen 16-bit parameters come
back upcast to fp32, which is exact), with one addition: for ZeRO-1, where DeepSpeed's converter drops
frozen parameters (the engine saves no list of them), they are taken from the module state.
"""

from __future__ import annotations

import bisect
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from .deepspeed_file_schema import check_model_states, check_optimizer_states
from .format import CheckpointError
from .safe_unpickle import TorchZipFile
from .schema import read_latest
from .trust import check_child_dir

__all__ = ["DeepSpeedCheckpoint", "ZeroFp32StateDict", "find_deepspeed_checkpoint", "is_deepspeed_dir"]

_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
# Output bytes per input byte a real checkpoint can reach: fp8 stored, fp32 written.
_AMPLIFICATION = 4
# (flat tensor, first element, element count): one contiguous run of a parameter's flat data
Piece = tuple[torch.Tensor, int, int]


def is_deepspeed_dir(path: Path) -> bool:
    """True when ``path`` holds DeepSpeed model or optimizer state files."""
    return path.is_dir() and any(_OPTIM_RE.match(p.name) or _MODEL_RE.match(p.name) for p in path.iterdir())


def find_deepspeed_checkpoint(path: str | os.PathLike, tag: str | None = None) -> Path | None:
    """The DeepSpeed tag directory for ``path`` (itself, ``path/tag`` or ``path/<latest>``), or None if not one.

    ``tag`` and the content of ``latest`` must name a directory next to them (no ``/``, ``..`` or absolute
    path; a symlink only to a sibling), as for shardkit checkpoints.

    Raises:
        CheckpointError: ``tag`` or the tag named by ``latest`` does not exist or leaves ``path``.
    """
    path = Path(path)
    if tag is not None:
        cand = check_child_dir(path, tag, f"{path}: --tag")
        if not cand.is_dir():
            raise CheckpointError(f"{cand}: no such checkpoint tag directory (--tag {tag!r}); "
                                  f"{path} holds {sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else []}")
        return cand if is_deepspeed_dir(cand) else None
    if is_deepspeed_dir(path):
        return path
    if (path / "latest").is_file() or (path / "latest").is_symlink():
        cand = path / read_latest(path)
        if is_deepspeed_dir(cand):
            return cand
    return None


def _numel(shape: Any) -> int:
    return math.prod(shape)


def _slice(parts: list[torch.Tensor], bounds: list[int], start: int, n: int, where: str) -> list[Piece]:
    """Pieces covering flat range ``[start, start + n)`` of the concatenation of ``parts``."""
    if start + n > bounds[-1]:
        raise CheckpointError(f"{where}: needs elements up to {start + n}, but the partitions hold {bounds[-1]}")
    pieces, pos, end = [], start, start + n
    r = bisect.bisect_right(bounds, pos) - 1
    while pos < end:
        take = min(end, bounds[r + 1]) - pos
        if take > 0:
            pieces.append((parts[r], pos - bounds[r], take))
            pos += take
        r += 1
    return pieces


def _bounds(parts: list[torch.Tensor]) -> list[int]:
    out = [0]
    for p in parts:
        out.append(out[-1] + p.numel())
    return out


class DeepSpeedCheckpoint:
    """One DeepSpeed ZeRO checkpoint, planned but not read: :meth:`read` fetches one tensor.

    Args:
        path: the tag directory, or its parent (``latest`` is followed, or ``tag`` picked).
        tag: the tag directory name (``global_step14``); default from ``latest``.
        exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.

    Raises:
        CheckpointError: not a DeepSpeed checkpoint, a rank file missing or truncated, an unsupported
            layout (tensor or pipeline parallelism), or partitions that do not add up.
    """

    def __init__(self, path: str | os.PathLike, tag: str | None = None,
                 exclude_frozen_parameters: bool = False) -> None:
        d = find_deepspeed_checkpoint(path, tag)
        if d is None:
            raise CheckpointError(f"{path}: not a DeepSpeed checkpoint (no *_model_states.pt / *_optim_states.pt "
                                  "here or in the tag named by `latest`)")
        self.path = d
        self._files: list[TorchZipFile] = []
        try:
            self._plan(exclude_frozen_parameters)
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> Any:
        f = TorchZipFile(self.path / name)  # a regular file, not a symlink or FIFO (checked on its descriptor)
        self._files.append(f)
        return f.load()

    def _rank_files(self) -> list[str]:
        found: dict[int, str] = {}
        for p in sorted(self.path.iterdir()):
            m = _OPTIM_RE.match(p.name)
            if not m:
                continue
            if int(m.group(2)) != 0:
                raise CheckpointError(f"{p}: tensor/pipeline-parallel DeepSpeed checkpoints (mp_rank_{m.group(2)}) "
                                      "are not supported; only data-parallel ZeRO")
            if int(m.group(1)) in found:
                raise CheckpointError(f"{self.path}: two optimizer files for rank {m.group(1)}: "
                                      f"{found[int(m.group(1))]} and {p.name}")
            found[int(m.group(1))] = p.name
        if not found:
            raise CheckpointError(f"{self.path}: no *_optim_states.pt files; zero-to-fp32 needs a ZeRO checkpoint "
                                  "saved with its optimizer states")
        if 0 not in found:
            raise CheckpointError(f"{self.path}: rank 0's optimizer file is missing (found ranks {sorted(found)})")
        return [found[r] for r in sorted(found)]

    def _optim_states(self) -> list[dict]:
        names = self._rank_files()
        first = check_optimizer_states(self._open(names[0]), self.path / names[0])
        world = first["partition_count"]
        have = {n.removeprefix("bf16_") for n in names}
        # NOTE: ranks past the files present are not listed one by one: the count is the file's claim (10**9?)
        shown = range(min(world, len(names) + 8))
        missing = [n for n in (f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in shown) if n not in have]
        if missing or world != len(names):
            raise CheckpointError(f"{self.path}: saved by {world} ranks (partition_count in {names[0]}), but "
                                  f"{len(names)} optimizer files are here; missing: {missing[:8] or 'none'}"
                                  f"{' and more' if world > len(shown) else ''} (extra files from an older save?)")
        states = [first] + [check_optimizer_states(self._open(n), self.path / n) for n in names[1:]]
        for n, st in zip(names[1:], states[1:]):
            if (st["zero_stage"], st["partition_count"]) != (first["zero_stage"], world):
                raise CheckpointError(f"{self.path / n}: ZeRO stage {st['zero_stage']} on {st['partition_count']} "
                                      f"ranks, but {names[0]} says stage {first['zero_stage']} on {world}; the files "
                                      "do not belong together")
        self.world_size = world
        self.zero_stage = first["zero_stage"]
        return states

    def _model_states(self) -> list[dict]:
        if self.zero_stage <= 2:
            names = ["mp_rank_00_model_states.pt"]
        else:
            names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(self.world_size)]
        return [check_model_states(self._open(n), self.path / n) for n in names]

    def _plan(self, exclude_frozen: bool) -> None:
        optim = self._optim_states()
        models = self._model_states()
        m0 = models[0]
        self.ds_version = m0["ds_version"]
        self.sources: dict[str, tuple[torch.Size, torch.dtype, list[Piece]]] = {}
        buffer_names = set(m0["buffer_names"])
        for k, v in m0["module"].items():
            if k in buffer_names:
                self.sources[k] = (v.shape, v.dtype, [(v, 0, v.numel())])
        if not exclude_frozen:
            for name, shape in (m0["frozen_param_shapes"] or {}).items():
                self._plan_frozen(models, name, shape)
        if len({len(o["groups"]) for o in optim}) != 1:
            raise CheckpointError(f"{self.path}: the ranks' optimizer files hold different numbers of parameter "
                                  "groups; the files do not belong together")
        if self.zero_stage <= 2:
            self._plan_zero12(optim, m0["param_shapes"])
        else:
            self._plan_zero3(optim, m0["param_shapes"])
        shared = m0["shared_params"]
        if self.zero_stage == 1 and m0["frozen_param_shapes"] is None and not exclude_frozen:
            self._frozen_from_module(m0, shared)
        self.aliases = {a: t for a, t in shared.items() if t in self.sources}
        self._check_amplification()

    def _check_amplification(self) -> None:
        """Refuses a plan whose output dwarfs the files: views may share bytes (each within its storage), so a
        few KB of pickle could otherwise name the same 1 GB storage a million times and fill the disk."""
        out = sum(_numel(shape) * (4 if dtype.is_floating_point else dtype.itemsize)
                  for shape, dtype, _ in self.sources.values())
        have = sum(f.size for f in self._files)
        if out > _AMPLIFICATION * have + (1 << 20):
            raise CheckpointError(f"{self.path}: the checkpoint's tensors add up to {out} bytes of fp32 output from "
                                  f"{have} bytes of files; tensors reuse the same bytes, refusing it (a real "
                                  "checkpoint is at most as large as its output, times 4 for fp8)")

    def _plan_frozen(self, models: list[dict], name: str, shape: torch.Size) -> None:
        """A frozen parameter: each rank's model file holds its fragment (ZeRO-3) or the whole (ZeRO-1/2)."""
        frags = [m["frozen_param_fragments"].get(name) for m in models]
        if any(f is None for f in frags):
            raise CheckpointError(f"{self.path}: frozen parameter {name!r:.200} has no fragment in every model-states "
                                  "file; the checkpoint is incomplete")
        if sum(f.numel() for f in frags) < _numel(shape):  # checked before read() allocates the claimed size
            raise CheckpointError(f"{self.path}: frozen parameter {name!r:.200} claims shape {list(shape)}, but its "
                                  f"fragments hold {sum(f.numel() for f in frags)} elements")
        self.sources[name] = (shape, frags[0].dtype, [(f.reshape(-1), 0, f.numel()) for f in frags])

    def _frozen_from_module(self, m0: dict, shared: Mapping) -> None:
        """ZeRO-1 saves no frozen-parameter list (DeepSpeed's converter then drops them); the module
        state holds every weight whole, so what is neither trained, a buffer nor an alias is frozen."""
        trained = {k for d in m0["param_shapes"] for k in d}
        buffers = set(m0["buffer_names"])
        for k, v in m0["module"].items():
            if k not in trained and k not in buffers and k not in shared and k not in self.sources:
                self.sources[k] = (v.shape, v.dtype, [(v, 0, v.numel())])

    def _plan_zero12(self, optim: list[dict], param_shapes: list[Mapping]) -> None:
        groups = [o["groups"] for o in optim]
        paddings = optim[0]["paddings"]
        if len(param_shapes) != len(groups[0]):
            raise CheckpointError(f"{self.path}: {len(param_shapes)} parameter groups in the model file, "
                                  f"{len(groups[0])} in the optimizer files")
        if paddings is not None and [len(row) for row in paddings] != [len(d) for d in param_shapes]:
            raise CheckpointError(f"{self.path}: param_alignment_paddings does not list one padding per parameter "
                                  "of each group; the files do not belong together")
        for g, shapes in enumerate(param_shapes):
            parts = [groups[r][g].reshape(-1) for r in range(self.world_size)]
            bounds = _bounds(parts)
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = _numel(shape)
                self.sources[name] = (shape, parts[0].dtype,
                                      _slice(parts, bounds, offset, n, f"{self.path}: group {g} {name}"))
                offset += n + (paddings[g][i] if paddings is not None else 0)
            align = 2 * self.world_size  # DeepSpeed pads each flat group to a multiple of 2 x world size
            if -(-offset // align) != -(-bounds[-1] // align):
                raise CheckpointError(f"{self.path}: group {g}'s parameters take {offset} elements, but its "
                                      f"partitions hold {bounds[-1]}; the files do not belong together")

    def _plan_zero3(self, optim: list[dict], param_shapes: list[Mapping]) -> None:
        ranks = [[t.reshape(-1) for t in o["groups"]] for o in optim]
        sizes = [[t.numel() for t in r] for r in ranks]
        odd = next((r for r, s in enumerate(sizes) if s != sizes[0]), None)
        if odd is not None or not ranks[0]:
            raise CheckpointError(f"{self.path}: rank {odd or 0}'s fp32 partitions differ in size from rank 0's (or "
                                  "hold none); the files do not belong together")
        bounds = _bounds(ranks[0])
        offset = 0
        for name, shape in ((k, v) for d in param_shapes for k, v in d.items()):
            n = _numel(shape)
            part = -(-n // self.world_size)  # integer ceil: a float one overflows on a crafted 10**400
            pieces = [p for r in range(self.world_size)
                      for p in _slice(ranks[r], bounds, offset, part, f"{self.path}: rank {r} {name}")]
            self.sources[name] = (shape, ranks[0][0].dtype, pieces)
            offset += part
        if offset != bounds[-1]:
            raise CheckpointError(f"{self.path}: the parameters take {offset} elements per rank, but each rank's "
                                  f"partition holds {bounds[-1]}; the files do not belong together")

    def keys(self) -> list[str]:
        """Output names in DeepSpeed's order (buffers, frozen, trainable), then the shared aliases."""
        return [*self.sources, *self.aliases]

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """(shape, dtype of :meth:`read`'s result): floating tensors come back as fp32."""
        shape, dtype, _ = self.sources[self.aliases.get(key, key)]
        return shape, (torch.float32 if dtype.is_floating_point else dtype)

    def read(self, key: str) -> torch.Tensor:
        """Reads one tensor (an alias reads its target) into fresh memory, then drops the file pages read."""
        shape, dtype, pieces = self.sources[self.aliases.get(key, key)]
        n = _numel(shape)
        out = torch.empty(n, dtype=self.spec(key)[1])
        pos, touched = 0, False
        for flat, start, take in pieces:
            take = min(take, n - pos)  # ZeRO-3's last rank carries padding past the end
            if take <= 0:
                break
            if not self._pread(out[pos: pos + take], flat, start):
                out[pos: pos + take].copy_(flat.reshape(-1)[start: start + take])
                touched = True
            pos += take
        if pos != n:
            raise CheckpointError(f"{self.path}: {key} has {pos} of its {n} elements in the files")
        if touched:
            self.release()
        return out.view(shape)

    def _pread(self, out: torch.Tensor, flat: torch.Tensor, start: int) -> bool:
        """Reads a same-dtype contiguous run straight from its file into ``out``: no page-cache mapping, no copy."""
        if flat.dtype != out.dtype or not flat.is_contiguous():
            return False
        for f in self._files:
            offset = f.file_offset(flat)
            if offset is not None:
                f.read_into(out, offset + start * flat.element_size())
                return True
        return False

    def release(self) -> None:
        """Drops the file pages read so far (bounded memory while streaming)."""
        for f in self._files:
            f.release()

    def close(self) -> None:
        """Unmaps the files."""
        for f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> DeepSpeedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ZeroFp32StateDict(Mapping):
    """A lazy ``{name: fp32 tensor}`` view of a checkpoint: each lookup reads that tensor from disk.

    Shared (tied) parameters appear under every name, as in DeepSpeed's result; :attr:`aliases` maps
    each alias to the name it shares with.
    """

    def __init__(self, checkpoint: DeepSpeedCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.aliases = dict(checkpoint.aliases)
        self._keys = checkpoint.keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.checkpoint.sources and key not in self.aliases:
            raise KeyError(key)
        return self.checkpoint.read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self.checkpoint.sources or key in self.aliases

    def shape(self, key: str) -> torch.Size:
        """The tensor's shape, without reading it."""
        return self.checkpoint.spec(key)[0]

    def dtype(self, key: str) -> torch.dtype:
        """The tensor's dtype as :meth:`__getitem__` returns it, without reading it."""
        return self.checkpoint.spec(key)[1]
