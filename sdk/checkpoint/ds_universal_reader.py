"""Reading DeepSpeed universal checkpoints (``ds_to_universal`` output) without DeepSpeed, as hostile input.

A universal checkpoint is a tag directory (named by its parent's ``latest_universal``) holding DeepSpeed's model
states file(s) (``mp_rank_00_model_states.pt`` from ZeRO-1/2, ``zero_pp_rank_R_mp_rank_00_model_states.pt`` from
ZeRO-3), ``zero/optimizer_state.pt`` (the param groups' hyperparameters, and under ZeRO-3 the step), and one
directory per parameter, ``zero/<name>/``, with ``fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (the whole fp32
tensor, bare or as ``{"param": tensor}``) and, from ZeRO-1/2, ``step.pt``.

:class:`UniversalCheckpoint` plans from the model states file (names, shapes, groups, buffers) and reads one
tensor at a time: every name becomes a path only as a plain child of its directory, every file goes through the
allowlist unpickler (:mod:`.safe_unpickle`, memory-mapped, nothing executed), and every tensor must hold exactly
the elements its parameter's shape says before a byte of it is copied, so a claimed size is bounded by the bytes
that exist.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .deepspeed_file_schema import check_model_states
from .format import CheckpointError
from .safe_unpickle import TorchZipFile
from .schema import read_small_file
from .trust import check_child_dir, describe, member_path

__all__ = ["LATEST_UNIVERSAL", "MODEL_STATE_FILES", "STATE_KEYS", "UNIVERSAL_DIR", "UniversalCheckpoint",
           "find_universal_checkpoint"]

UNIVERSAL_DIR = "zero"
OPTIMIZER_STATE_FILE = "optimizer_state.pt"
LATEST_UNIVERSAL = "latest_universal"
# ZeRO-1/2's model states file, then ZeRO-3's (rank 0's; DeepSpeed's universal loader reads that one).
MODEL_STATE_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# Per-element Adam state ds_to_universal writes beside the fp32 weight (it knows no other optimizer).
STATE_KEYS = ("exp_avg", "exp_avg_sq")
_MAX_STEP = 1 << 40
_ADVICE = "the universal checkpoint is corrupt or was edited; convert the ZeRO checkpoint again with ds_to_universal"
# Hyperparameter values a param group may carry into a shardkit checkpoint: plain numbers, flags, names, and
# short tuples of numbers (Adam's betas).
_PLAIN = (bool, int, float, str, type(None))


def find_universal_checkpoint(path: str | os.PathLike) -> Path | None:
    """The universal tag directory for ``path`` (itself, or the one its ``latest_universal`` names), or None."""
    path = Path(path)
    if _looks_universal(path):
        return path
    pointer = path / LATEST_UNIVERSAL
    if pointer.is_file() and not pointer.is_symlink():
        raw = read_small_file(pointer, 4096, f"`{LATEST_UNIVERSAL}`")
        try:
            tag = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{pointer}: is not UTF-8 text; it must hold the name of a tag directory") from None
        cand = check_child_dir(path, tag, str(pointer))
        if _looks_universal(cand):
            return cand
    return None


def _looks_universal(path: Path) -> bool:
    zero = path / UNIVERSAL_DIR
    return (path.is_dir() and zero.is_dir() and (zero / OPTIMIZER_STATE_FILE).is_file()
            and any((path / n).is_file() for n in MODEL_STATE_FILES))


class _Fields:
    """Errors that name the file and the field."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def fail(self, field: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: field {field} {why}; {_ADVICE}")

    def step(self, v: Any, field: str) -> int:
        if isinstance(v, torch.Tensor):
            if v.numel() != 1 or v.is_complex():
                raise self.fail(field, f"is a tensor of shape {list(v.shape)}, not one step count")
            v = v.item()
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if type(v) is not int or not 0 <= v < _MAX_STEP:
            raise self.fail(field, f"is {describe(v)}, not a step count (an integer from 0 to {_MAX_STEP})")
        return v


class UniversalCheckpoint:
    """One universal checkpoint, planned but not read: :meth:`read` fetches one tensor.

    Args:
        path: the tag directory (``global_step3_universal``) or its parent holding ``latest_universal``.

    Attributes:
        params: trained parameter names mapped to their shapes, in DeepSpeed's order.
        groups: the param groups' hyperparameters, ``params`` holding the parameter names.
        buffers: persistent buffers from the model states file, whole.
        frozen: parameters outside the optimizer (ZeRO-1/2 writes their weight to ``zero/<name>/fp32.pt``).
        aliases: tied names mapped to the parameter whose weight they share.
        step: the optimizer's step count; ``global_steps``: the engine's.

    Raises:
        CheckpointError: naming the file and the field: not a universal checkpoint, a name that is no plain
            child, a missing or truncated file, a pickle asking for a global outside the allowlist, a tensor
            whose size is not its parameter's, steps that disagree.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        d = find_universal_checkpoint(path)
        if d is None:
            raise CheckpointError(f"{path}: not a DeepSpeed universal checkpoint (no {UNIVERSAL_DIR}/"
                                  f"{OPTIMIZER_STATE_FILE} and {' or '.join(MODEL_STATE_FILES)} here, nor a "
                                  f"`{LATEST_UNIVERSAL}` naming such a directory)")
        self.path = d
        self.zero = member_path(d, UNIVERSAL_DIR, str(d))
        self._open_files: list[TorchZipFile] = []
        try:
            self._plan()
        finally:
            self.release()

    # ---------------------------------------------------------------- planning
    def _load(self, path: Path) -> Any:
        f = TorchZipFile(path)  # a regular file, not a symlink or FIFO; the pickle through the allowlist
        self._open_files.append(f)
        return f.load()

    def _plan(self) -> None:
        name = next(n for n in MODEL_STATE_FILES if (self.path / n).is_file())
        model_file = member_path(self.path, name, str(self.path))
        raw = self._load(model_file)
        model = check_model_states(raw, model_file)
        self.ds_version = model["ds_version"]
        self.global_steps = _Fields(model_file).step(raw.get("global_steps", 0), "global_steps")
        self.param_shapes: list[dict[str, torch.Size]] = model["param_shapes"]
        self.params: dict[str, torch.Size] = {}
        for sub in self.param_shapes:
            for pname, shape in sub.items():
                if pname in self.params:
                    raise _Fields(model_file).fail("param_shapes", f"names {describe(pname)} twice")
                self.params[pname] = shape
        names = set(model["buffer_names"])
        self.buffers = {k: v.clone() for k, v in model["module"].items() if k in names}
        self.frozen = {k: s for k, s in (model["frozen_param_shapes"] or {}).items() if k not in self.params}
        for pname in (*self.params, *self.frozen):  # every name a plain child directory before anything is read
            self._param_dir(pname)
        # tied weights: DeepSpeed keeps one copy and names the others (a strategy's loader may ask for every name)
        self.aliases = {a: t for a, t in model["shared_params"].items()
                        if (t in self.params or t in self.frozen) and a not in self.params and a not in self.buffers}
        optim_file = member_path(self.zero, OPTIMIZER_STATE_FILE, str(self.zero))
        self._plan_groups(self._load(optim_file), optim_file)

    def _plan_groups(self, sd: Any, file: Path) -> None:
        f = _Fields(file)
        if not isinstance(sd, Mapping):
            raise f.fail("(the whole file)", f"is {describe(sd)}, not a dict")
        groups = sd.get("param_groups")
        if not isinstance(groups, list) or not groups or len(groups) > len(self.param_shapes):
            raise f.fail("param_groups", f"is {describe(groups)}, not a list of 1 to {len(self.param_shapes)} groups "
                         f"(the model states file has {len(self.param_shapes)} flat groups)")
        owner: dict[int, int] = {}
        self.groups: list[dict[str, Any]] = []
        for g, group in enumerate(groups):
            where = f"param_groups[{g}]"
            if not isinstance(group, Mapping):
                raise f.fail(where, f"is {describe(group)}, not a dict")
            flat = group.get("params")
            if not isinstance(flat, list) or not all(type(i) is int for i in flat):
                raise f.fail(f"{where}.params", f"is {describe(flat)}, not a list of flat group numbers")
            for i in flat:
                if not 0 <= i < len(self.param_shapes) or i in owner:
                    raise f.fail(f"{where}.params", f"names flat group {i}, which is out of range or in two groups")
                owner[i] = g
            if not all(isinstance(k, str) and len(k) <= 200 for k in group):
                raise f.fail(where, "has a key that is not a short string")
            hyper = {k: self._hyper(f, f"{where}.{k}", v) for k, v in group.items() if k != "params"}
            self.groups.append({**hyper, "params": [n for i in flat for n in self.param_shapes[i]]})
        if len(owner) != len(self.param_shapes):
            lost = sorted(set(range(len(self.param_shapes))) - set(owner))
            raise f.fail("param_groups", f"leaves flat groups {lost[:8]} of the model states file in no group")
        self.step = self._plan_step(sd, f)

    @staticmethod
    def _hyper(f: _Fields, field: str, v: Any) -> Any:
        if type(v) in _PLAIN and (not isinstance(v, str) or len(v) <= 200):
            return v
        if type(v) in (list, tuple) and len(v) <= 8 and all(type(x) in (int, float, bool) for x in v):
            return tuple(v) if type(v) is tuple else list(v)
        raise f.fail(field, f"is {describe(v)}; a hyperparameter must be a number, flag, short name or a short "
                     "tuple of numbers")

    def _plan_step(self, sd: Mapping, f: _Fields) -> int:
        """ZeRO-3 keeps the step in the optimizer state's sub-groups; ZeRO-1/2 in every ``zero/<name>/step.pt``."""
        inner = sd.get("optimizer_state_dict")
        steps: dict[str, int] = {}
        if isinstance(inner, Mapping) and isinstance(inner.get("state"), Mapping):
            for k, st in inner["state"].items():
                if isinstance(st, Mapping) and "step" in st:
                    steps[f"optimizer_state_dict.state[{describe(k)}].step"] = f.step(st["step"], "step")
        if not steps:
            for pname in self.params:
                path = member_path(self._param_dir(pname), "step.pt", str(self.zero / pname))
                if path.exists():
                    steps[str(path)] = _Fields(path).step(self._load(path), "(the whole file)")
                    self.release()
        if not steps:
            raise f.fail("optimizer_state_dict.state", f"holds no step, and no {UNIVERSAL_DIR}/<name>/step.pt exists "
                         "either; the optimizer's step count cannot be recovered")
        if len(set(steps.values())) != 1:
            (a, x), (b, y) = next(iter(steps.items())), next((k, v) for k, v in steps.items()
                                                             if v != next(iter(steps.values())))
            raise CheckpointError(f"{self.path}: the step counts disagree ({a} says {x}, {b} says {y}); {_ADVICE}")
        return next(iter(steps.values()))

    # ---------------------------------------------------------------- reading
    def _param_dir(self, pname: str) -> Path:
        d = member_path(self.zero, pname, f"{self.zero} (parameter {describe(pname, 120)})")
        if not d.is_dir():
            raise CheckpointError(f"{d}: missing; the universal checkpoint has no directory for parameter "
                                  f"{describe(pname, 120)}")
        return d

    def shape(self, pname: str) -> torch.Size:
        """The shape of a trained or frozen parameter, of a tied alias, or of a buffer."""
        pname = self.aliases.get(pname, pname)
        if pname in self.buffers:
            return self.buffers[pname].shape
        return self.params[pname] if pname in self.params else self.frozen[pname]

    def read(self, pname: str, key: str = "fp32") -> torch.Tensor:
        """One whole fp32 tensor (``fp32``, ``exp_avg`` or ``exp_avg_sq`` of a parameter) in fresh memory.

        Raises:
            CheckpointError: the file is missing, not a torch.save zip, holds no tensor, or a tensor whose element
                count is not the parameter's (checked before any byte is copied).
        """
        pname = self.aliases.get(pname, pname)
        if pname in self.buffers:
            return self.buffers[pname].clone()
        shape = self.shape(pname)
        path = member_path(self._param_dir(pname), f"{key}.pt", str(self.zero / pname))
        obj = self._load(path)
        try:
            t = obj.get("param") if isinstance(obj, Mapping) else obj
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{path}: holds {describe(t)}, not a tensor (nor {{'param': tensor}}); {_ADVICE}")
            if t.numel() != math.prod(shape) or not t.is_floating_point():
                raise CheckpointError(f"{path}: holds a {t.dtype} tensor of shape {list(t.shape)}, but parameter "
                                      f"{describe(pname, 120)} has shape {list(shape)} in the model states file; "
                                      f"{_ADVICE}")
            return t.detach().reshape(shape).to(torch.float32, copy=True)
        finally:
            self.release()

    def release(self) -> None:
        """Unmaps the files read so far (bounded memory while streaming)."""
        for f in self._open_files:
            f.close()
        self._open_files = []
