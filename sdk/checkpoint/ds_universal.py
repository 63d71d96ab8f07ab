"""DeepSpeed universal checkpoints in and out: :func:`universal_to_shardkit` and :func:`shardkit_to_universal`.

In: a ``ds_to_universal`` output (per-parameter fp32 weight, ``exp_avg``, ``exp_avg_sq``, the step) becomes a
shardkit checkpoint that a Runner resumes under any strategy and world size: the model and the optimizer as
sharded entries of whole tensors, the optimizer's groups and step as the ``<name>.meta`` every strategy's loader
reads (strategies/zero/checkpoint.py describes it), and the Runner's own entries (the step count from DeepSpeed's
``global_steps``). The source is read as hostile input (:mod:`.ds_universal_reader`).

Out: a shardkit checkpoint (any strategy's save) becomes a universal tag directory that DeepSpeed's engine resumes
with ``"checkpoint": {"load_universal": true}`` at any ZeRO stage and world size: ``zero/<name>/{fp32,exp_avg,
exp_avg_sq,step}.pt``, ``zero/optimizer_state.pt`` and the model states file under both the ZeRO-1/2 and the
ZeRO-3 name; ``latest_universal`` beside it names it, as ``ds_to_universal`` leaves it.

Both stream tensor by tensor (memory near the largest tensor; a full, unsharded optimizer save is read whole, as
it was written) and write atomically: everything goes into a hidden sibling that is renamed into place when
complete, so a failed conversion leaves no destination at all.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .ds_universal_reader import (
    LATEST_UNIVERSAL,
    MODEL_STATE_FILES,
    OPTIMIZER_STATE_FILE,
    STATE_KEYS,
    UNIVERSAL_DIR,
    UniversalCheckpoint,
    find_universal_checkpoint,
)
from .format import (
    PRECISION_ENTRY,
    RUNNER_ENTRY,
    USER_KINDS_ENTRY,
    USER_VALUES_ENTRY,
    CheckpointError,
    fsync_dir,
    naming,
    write_failure,
)
from .reader import CheckpointReader
from .schema import check_runner_state
from .trust import describe, member_path
from .writer import CheckpointWriter

__all__ = ["is_universal_checkpoint", "shardkit_to_universal", "universal_to_shardkit"]

Progress = Callable[[int, int], None] | Any
# The optimizer entry's groups and step, in the layout the strategies' loaders read (``<optimizer>.meta``).
_META = "{}.meta"
_MODEL, _OPTIMIZER = "model", "optimizer"
# The DeepSpeed release whose universal layout this writer follows; its loader only asks that the field parses.
_DS_VERSION = "0.19.8"
_UC_INFO = {"universal_checkpoint_version": 0.4}


def is_universal_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a universal tag directory or holds a ``latest_universal`` pointer (whose target
    :func:`universal_to_shardkit` then checks, naming what is wrong)."""
    path = Path(path)
    try:
        return find_universal_checkpoint(path) is not None or (path / LATEST_UNIVERSAL).is_file()
    except CheckpointError:
        return True


def _check_destination(dst: str | os.PathLike, src: str | os.PathLike) -> Path:
    dst = Path(os.path.abspath(dst))
    real, source = dst.resolve(), Path(src).resolve()
    if real == source or source in real.parents:
        raise CheckpointError(f"{dst}: lies inside the checkpoint being converted ({src}); choose a destination "
                              "outside it")
    if dst.exists() or dst.is_symlink():
        raise CheckpointError(f"{dst}: already exists; a conversion writes a new directory and never replaces or "
                              "mixes with one: remove it first or choose another destination")
    return dst


class _Ticker:
    """Counts tensors written for ``progress``: a ``callable(done, total)``, or a bar with ``tick(tensor)``."""

    def __init__(self, total: int, progress: Any) -> None:
        self.done, self.total, self.progress = 0, total, progress

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.done += 1
        if callable(self.progress):
            self.progress(self.done, self.total)
        elif self.progress is not None:
            self.progress.tick(t)
        return t


# ---- universal -> shardkit ---------------------------------------------------------------------------------


def universal_to_shardkit(src: str | os.PathLike, dst: str | os.PathLike, *, progress: Progress = None) -> Path:
    """Converts a DeepSpeed universal checkpoint into a shardkit checkpoint directory ``dst``.

    ``runner.load(dst, {"model": model, "optimizer": optimizer})`` then resumes it under any strategy and world
    size: weights, Adam's moments, the step and the param groups' hyperparameters; the Runner's step count is
    DeepSpeed's ``global_steps``. Buffers come from the model states file; a learning-rate scheduler's state is not
    in a universal checkpoint and is not carried.

    Args:
        src: the universal tag directory (``global_step100_universal``) or its parent holding ``latest_universal``.
        dst: the new checkpoint directory (must not exist; its parent's ``latest`` is left alone).
        progress: called as ``progress(done, total)`` after each tensor written (or a bar's ``tick(tensor)``).

    Raises:
        CheckpointError: naming the file and field of the source that is wrong, or the destination's problem;
            nothing is left at ``dst``.
    """
    ckpt = UniversalCheckpoint(src)
    dst = _check_destination(dst, ckpt.path)
    model = [(n, b.dtype, tuple(b.shape)) for n, b in ckpt.buffers.items()]
    model += [(n, torch.float32, tuple(s)) for n, s in (*ckpt.frozen.items(), *ckpt.params.items())]
    model += [(a, torch.float32, tuple(ckpt.shape(a))) for a in ckpt.aliases]  # as FSDP's saves hold tied names
    moments = [(f"{n}/{k}", torch.float32, tuple(s)) for n, s in ckpt.params.items() for k in STATE_KEYS]
    tick = _Ticker(len(model) + len(moments), progress)
    trained = list(ckpt.params)
    meta = {"step": ckpt.step, "param_groups": ckpt.groups, "state_keys": list(STATE_KEYS), "loss_scaler": {},
            "scalars": {n: {"step": torch.tensor(float(ckpt.step))} for n in trained},
            "tensor_keys": {n: list(STATE_KEYS) for n in trained}}
    info = {"converted_from": "deepspeed-universal", "source": str(ckpt.path), "world_size": 1}
    with CheckpointWriter(dst, update_latest=False, info=info) as w:
        w.write_shard_streamed(_MODEL, model, lambda key: tick(ckpt.read(key)))
        w.write_shard_streamed(_OPTIMIZER, moments, lambda key: tick(ckpt.read(*key.rsplit("/", 1))))
        w.write_state(_META.format(_OPTIMIZER), meta)
        w.write_json(USER_KINDS_ENTRY, {_MODEL: "module", _OPTIMIZER: "optimizer"})
        w.write_state(USER_VALUES_ENTRY, {})
        # as a Runner's save right after a step: no accumulation window open
        w.write_json(RUNNER_ENTRY, {"micro_step": 0, "boundary": False, "optimizer_steps": ckpt.global_steps})
        w.write_json(PRECISION_ENTRY, {})
    return dst


# ---- shardkit -> universal ---------------------------------------------------------------------------------


class _ShardkitSource:
    """The model and optimizer of a shardkit checkpoint, read one tensor at a time."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.model, self.optimizer = self._entry_names()
        self.keys = reader.sharded_keys(self.model)
        meta_name = _META.format(self.optimizer)
        if reader.has(meta_name):  # a sharded save (FSDP, TP, ZeRO): tensors read one at a time
            meta = reader.read_state(meta_name)
            self.groups, self._full = meta["param_groups"], None
            scalars = meta.get("scalars", {})
            steps = {n: s["step"] for n, s in scalars.items() if "step" in s}
            if "step" in meta:
                steps.setdefault("", meta["step"])
            self._tensor_keys = meta.get("tensor_keys", {})
        else:  # a full save (SingleDevice, DDP, FSDP's full state dict): one state, written whole by one process
            full = reader.read_state(self.optimizer)
            self.groups, self._full = full["param_groups"], full["state"]
            steps = {n: s["step"] for n, s in full["state"].items() if "step" in s}
            self._tensor_keys = {n: [k for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
                                 for n, s in full["state"].items()}
        self.trained = [n for g in self.groups for n in g["params"]]
        self.step = self._one_step(steps)
        for n in self.trained:
            missing = [k for k in STATE_KEYS if k not in self._tensor_keys.get(n, ())]
            if n not in self.keys or missing:
                what = f"no {missing[0]!r} state" if n in self.keys else "no weight in the model entry"
                raise CheckpointError(f"{reader.path}: parameter {n!r} has {what}; a universal checkpoint holds "
                                      f"Adam's {' and '.join(STATE_KEYS)} for every trained parameter, so only an "
                                      "Adam/AdamW run's checkpoint (saved after its first step) converts")

    def _entry_names(self) -> tuple[str, str]:
        r = self.reader
        default = {_MODEL: "module", _OPTIMIZER: "optimizer"}
        kinds = r.read_json(USER_KINDS_ENTRY) if r.has(USER_KINDS_ENTRY) else default
        if not isinstance(kinds, dict) or not all(isinstance(v, str) for v in kinds.values()):
            raise CheckpointError(f"{r.path}: entry {USER_KINDS_ENTRY!r} must map each saved name to its kind; the "
                                  "checkpoint is corrupt or was edited")
        found = {kind: [k for k, v in kinds.items() if v == kind] for kind in ("module", "optimizer")}
        for kind, names in found.items():
            if len(names) != 1:
                raise CheckpointError(f"{r.path}: holds {len(names)} {kind} entries ({names[:4]}); a universal "
                                      f"checkpoint holds one model and its optimizer")
        return found["module"][0], found["optimizer"][0]

    def _one_step(self, steps: Mapping[str, Any]) -> int:
        values = {int(v.item() if isinstance(v, torch.Tensor) else v) for v in steps.values()}
        if len(values) != 1:
            raise CheckpointError(f"{self.reader.path}: optimizer {self.optimizer!r} holds "
                                  f"{'no step' if not values else f'different steps {sorted(values)[:4]}'}; the "
                                  "universal checkpoint needs the one step count of an Adam run")
        return values.pop()

    def read(self, name: str, key: str) -> torch.Tensor:
        if key == "fp32":
            return self.reader.read_full(self.model, name).to(torch.float32)
        if self._full is not None:
            return self._full[name][key].to(torch.float32)
        return self.reader.read_full(self.optimizer, f"{name}/{key}").to(torch.float32)


@contextmanager
def _staged(dst: Path) -> Iterator[Path]:
    """A hidden sibling of ``dst`` to write into; renamed to ``dst`` on success, removed on any failure."""
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:16]}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        os.rename(tmp, dst)
        fsync_dir(dst.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(e, f"nothing was written at {dst}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(obj: Any, path: Path) -> None:
    with naming(path), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _plain_group(group: Mapping[str, Any], index: int) -> dict[str, Any]:
    return {**{k: v for k, v in group.items() if k != "params"}, "params": [index]}


def shardkit_to_universal(src: str | os.PathLike, dst: str | os.PathLike, *, progress: Progress = None,
                          point_latest: bool = True) -> Path:
    """Writes a shardkit checkpoint (any strategy, any world size) as a DeepSpeed universal tag directory ``dst``.

    DeepSpeed resumes it with ``{"checkpoint": {"load_universal": true}}`` and ``engine.load_checkpoint(parent)``
    (``latest_universal`` in ``dst``'s parent names it) at any ZeRO stage and data-parallel size: the fp32 weights,
    Adam's moments, the step (a 0-d float tensor, as torch's Adam keeps it) and each group's hyperparameters.
    DeepSpeed's universal load restores trained parameters only: buffers and frozen parameters are written into
    the model states file's ``module`` but its loader leaves them as the model was built; the scheduler's state is
    not carried (load with ``load_lr_scheduler_states=False``).

    Args:
        src: a shardkit checkpoint directory, or its parent holding ``latest``.
        dst: the new tag directory (must not exist), e.g. ``ds_ckpt/global_step100_universal``.
        progress: called as ``progress(done, total)`` after each tensor written (or a bar's ``tick(tensor)``).
        point_latest: write ``latest_universal`` beside ``dst`` naming it (False for a caller that moves ``dst``).

    Raises:
        CheckpointError: the source is not a shardkit checkpoint of one model and an Adam-like optimizer, a
            parameter name is not a plain file name, or a write failed; nothing is left at ``dst``.
    """
    with CheckpointReader(src) as reader:
        source = _ShardkitSource(reader)
        dst = _check_destination(dst, reader.path)
        trained = set(source.trained)
        others = {k: reader.read_full(source.model, k) for k in source.keys if k not in trained}
        tick = _Ticker(len(source.trained) * (len(STATE_KEYS) + 1) + len(others), progress)
        step = torch.tensor(float(source.step))
        with _staged(dst) as tmp:
            zero = tmp / UNIVERSAL_DIR
            zero.mkdir()
            dirs = {n: member_path(zero, n, f"{reader.path}: parameter {describe(n, 120)}") for n in source.trained}
            for d in dirs.values():
                d.mkdir()
                _save(step.clone(), d / "step.pt")
            # one entry's files mapped at a time (the reader maps and hashes a file whole): the model's, then the
            # optimizer's
            for keys in (("fp32",), STATE_KEYS):
                for name, d in dirs.items():
                    for key in keys:
                        _save({"param": tick(source.read(name, key)), "cat_dim": 0}, d / f"{key}.pt")
                reader.close()
            for name, t in others.items():  # as ds_to_universal writes the weights no optimizer holds
                d = member_path(zero, name, f"{reader.path}: tensor {describe(name, 120)}")
                d.mkdir()
                _save({"param": tick(t).float() if t.is_floating_point() else t, "cat_dim": 0}, d / "fp32.pt")
            groups = [_plain_group(g, i) for i, g in enumerate(source.groups)]
            _save({"param_groups": groups, "ds_version": _DS_VERSION,
                   "optimizer_state_dict": {"state": {i: {"step": step.clone()} for i in range(len(groups))},
                                            "param_groups": groups}}, zero / OPTIMIZER_STATE_FILE)
            steps = (reader.read_json(RUNNER_ENTRY, check=check_runner_state)["optimizer_steps"]
                     if reader.has(RUNNER_ENTRY) else source.step)
            model_state = {
                "module": others, "buffer_names": list(others), "frozen_param_shapes": None, "shared_params": {},
                "param_shapes": [{n: tuple(source.keys[n][0]) for n in g["params"]} for g in source.groups],
                "lr_scheduler": None, "global_steps": int(steps), "skipped_steps": 0, "dp_world_size": 1,
                "mp_world_size": 1, "ds_version": _DS_VERSION, "universal_checkpoint_info": dict(_UC_INFO)}
            for name in MODEL_STATE_FILES:  # ZeRO-1/2's and ZeRO-3's loaders each look for their own name
                _save(model_state, tmp / name)
    if point_latest:
        _point_latest(dst)
    return dst


def _point_latest(dst: Path) -> None:
    """``latest_universal`` beside ``dst`` names it (DeepSpeed's loader reads it when given no tag)."""
    pointer, tmp = dst.parent / LATEST_UNIVERSAL, dst.parent / f".{LATEST_UNIVERSAL}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with naming(tmp), open(tmp, "w") as f:
            f.write(dst.name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, pointer)
        fsync_dir(dst.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_failure(e, f"{dst} is complete, but {pointer} does not name it: pass tag={dst.name!r} to "
                               "load_checkpoint") from None
