"""Reading and checking the ``optimizer.pt`` and ``scheduler.pt`` of a checkpoint Hugging Face's Trainer wrote.

Both files are hostile input. They are read through shardkit's allowlist reader
(:class:`shardkit.checkpoint.safe_unpickle.TorchZipFile`), which reads the zip directory first, refuses a pickle
record that declares or inflates past its cap (a 1 MB deflated ``data.pkl`` can inflate to 1 GiB under
``torch.load``), maps tensor records only where they lie inside the file, and runs no code. The loaded objects
are then checked against this run's optimizer and scheduler (structure, parameter counts, tensor shapes, field
types and ranges) before anything is loaded into them: a refused file leaves the run's objects as they were, and
the error names the file, the field and the fix.

What is loaded is what Hugging Face's resume loads: the optimizer's per-parameter state and its param groups'
hyperparameters (so the first resumed step runs at the learning rate the schedule had reached, not at the
initial one), and the scheduler's state. The file holds whole tensors indexed in Hugging Face's parameter order;
they are re-keyed by parameter name, the form every strategy's loader takes a full save in, so under FSDP,
TensorParallel and ZeRO each rank loads its part of the moments, as from one of shardkit's own checkpoints.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint.format import CheckpointError
from shardkit.checkpoint.safe_unpickle import TorchZipFile
from shardkit.checkpoint.trust import describe

__all__ = ["checked_optimizer_state", "checked_scheduler_state", "read_torch_file"]

_NON_NEGATIVE = ("lr", "initial_lr", "weight_decay", "momentum", "dampening", "eps")
# how this run computes the step (its kernels), not where training stands: kept from this run's optimizer
_IMPLEMENTATION_FIELDS = ("foreach", "fused", "capturable", "differentiable")
# param-group fields that torch versions and schedulers add or drop: their absence says nothing about the optimizer
_VERSION_FIELDS = ("foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay",
                   "initial_lr", "params")
# bookkeeping flags some torch versions add to a scheduler's state and others lack: a file without them keeps
# this run's values
_SCHEDULER_OPTIONAL = ("_is_initial", "_get_lr_called_within_step")


def read_torch_file(path: Path) -> Any:
    """The object a ``torch.save`` file holds, read with caps and no code run; tensors are copied out of the file."""
    reader = TorchZipFile(path)
    try:
        value = reader.load()
        return _copied(value)
    except CheckpointError as err:
        text = str(err)
        raise CheckpointError(text if str(path) in text else f"{path}: {text}") from None
    finally:
        reader.close()


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def _refuse(path: Path, field: str, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"{path}: {field} {problem}; {fix}")


_FIX_OPTIMIZER = ("this optimizer.pt is damaged or from another model or optimizer: resume from another checkpoint, "
                  "or delete optimizer.pt and scheduler.pt to resume the weights with a fresh optimizer")
_FIX_SCHEDULER = ("this scheduler.pt is damaged or from another schedule: resume from another checkpoint, or "
                  "delete scheduler.pt to restart the schedule")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_hyperparameter(path: Path, field: str, saved: Any, current: Any) -> None:
    """``saved`` has the kind of ``current`` (a flag, a number, a tuple of numbers), finite, and >= 0 where the
    field is one no optimizer takes negative."""
    if current is None or saved is None or isinstance(current, bool):
        if not (saved is None or isinstance(saved, bool)):
            raise _refuse(path, field, f"is {describe(saved)}, not a flag (True, False or None)", _FIX_OPTIMIZER)
        return
    if _number(current):
        if not _number(saved) or not math.isfinite(saved):
            raise _refuse(path, field, f"is {describe(saved)}, not a finite number", _FIX_OPTIMIZER)
        if field.rsplit(".", 1)[-1] in _NON_NEGATIVE and saved < 0:
            raise _refuse(path, field, f"is {saved}, below 0", _FIX_OPTIMIZER)
        return
    if isinstance(current, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or len(saved) != len(current):
            raise _refuse(path, field, f"is {describe(saved)}, not {len(current)} values", _FIX_OPTIMIZER)
        for i, (s, c) in enumerate(zip(saved, current)):
            _check_hyperparameter(path, f"{field}[{i}]", s, c)
        if field.endswith("betas") and not all(0 <= b < 1 for b in saved):
            raise _refuse(path, field, f"is {describe(saved)}, outside [0, 1)", _FIX_OPTIMIZER)


def _check_entry(path: Path, name: str, index: int, entry: Any, shape: tuple[int, ...]) -> None:
    """One parameter's state: string keys; tensors of the parameter's shape (or scalars), finite; step >= 0."""
    where = f"state[{index}] ({name})"
    if not isinstance(entry, dict):
        raise _refuse(path, where, f"is {describe(entry)}, not a dict", _FIX_OPTIMIZER)
    for key, value in entry.items():
        field = f"{where}[{describe(key)}]"
        if not isinstance(key, str):
            raise _refuse(path, field, "has a key that is not a string", _FIX_OPTIMIZER)
        if isinstance(value, torch.Tensor):
            if value.ndim and tuple(value.shape) != shape:
                raise _refuse(path, field, f"has shape {list(value.shape)}, the parameter {list(shape)}",
                              _FIX_OPTIMIZER)
            if value.is_complex() or not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
                raise _refuse(path, field, f"holds {value.dtype}, not real numbers", _FIX_OPTIMIZER)
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise _refuse(path, field, "holds NaN or infinite values", _FIX_OPTIMIZER)
            number = float(value) if value.numel() == 1 and not value.ndim else None
        elif _number(value):
            number = value
        else:
            raise _refuse(path, field, f"is {describe(value)}, not a tensor or a number", _FIX_OPTIMIZER)
        if number is not None and not math.isfinite(number):
            raise _refuse(path, field, f"is {number}, not finite", _FIX_OPTIMIZER)
        if key == "step" and (number is None or number < 0 or number != int(number)):
            raise _refuse(path, field, f"is {describe(value)}, not a step count >= 0", _FIX_OPTIMIZER)


def _check_same_optimizer(path: Path, index: int, saved: dict, current: dict, optimizer_name: str) -> None:
    """The file's group has this optimizer's fields (AdamW's betas and eps, SGD's momentum...): state from
    another optimizer class would fail at the first step (a missing ``exp_avg``) or be read as something else."""
    missing = [k for k in current if k not in saved and k not in _VERSION_FIELDS]
    extra = [k for k in saved if k not in current and k not in _VERSION_FIELDS]
    if missing or extra:
        words = [f"lacks {', '.join(map(describe, missing))}" if missing else "",
                 f"has {', '.join(map(describe, extra))}" if extra else ""]
        raise _refuse(path, f"param_groups[{index}]", f"{' and '.join(w for w in words if w)}, fields this run's "
                      f"{optimizer_name} does not match: it was saved by another optimizer",
                      "resume with the optimizer it was saved with (TrainingArguments.optim), or delete "
                      "optimizer.pt to resume the weights with a fresh optimizer")


def _saved_groups(saved: Any, path: Path, count: int) -> list[dict]:
    """The file's param groups, checked to index exactly parameters 0..count-1, each once."""
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        keys = sorted(map(describe, saved)) if isinstance(saved, dict) else describe(saved)
        raise _refuse(path, "the top level", f"is {keys}, not an optimizer state dict (state, param_groups)",
                      _FIX_OPTIMIZER)
    groups, state = saved["param_groups"], saved["state"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not groups:
        raise _refuse(path, "param_groups", "is not a list of dicts", _FIX_OPTIMIZER)
    if not isinstance(state, dict):
        raise _refuse(path, "state", f"is {describe(state)}, not a dict", _FIX_OPTIMIZER)
    seen: list[int] = []
    for g, group in enumerate(groups):
        params = group.get("params")
        if not isinstance(params, list) or not all(type(i) is int for i in params):
            raise _refuse(path, f"param_groups[{g}]['params']", "is not a list of parameter indices",
                          _FIX_OPTIMIZER)
        if "lr" not in group:
            raise _refuse(path, f"param_groups[{g}]", "has no 'lr'", _FIX_OPTIMIZER)
        seen += params
    if len(seen) != count:
        raise CheckpointError(f"{path} holds optimizer state for {len(seen)} parameters, the model trains {count}: "
                              "it is from another model; resume with the model it was saved with")
    if sorted(seen) != list(range(count)):
        raise _refuse(path, "param_groups", f"index the parameters {describe(sorted(seen))}, not 0..{count - 1} "
                      "once each", _FIX_OPTIMIZER)
    stray = [i for i in state if type(i) is not int or not 0 <= i < count]
    if stray:
        raise _refuse(path, "state", f"has entries {describe(stray)} for no parameter", _FIX_OPTIMIZER)
    return groups


def checked_optimizer_state(saved: Any, path: Path, groups: list[dict], shapes: dict[str, tuple[int, ...]],
                            hf_order: list[str], optimizer_name: str) -> dict:
    """The file's state as this run's optimizer takes it, keyed by parameter name (the structure of
    ``shardkit.checkpoint.optimizer_state_by_name``, whole tensors, which every strategy loads at its own layout):
    each parameter's state found by name, and each of this run's groups with the file's hyperparameters.

    ``groups`` is this run's param groups with parameter names (``Strategy.named_param_groups``), ``shapes`` the
    parameters' whole shapes, ``hf_order`` the trainable parameters' names in Hugging Face's order (the file's
    indices). Everything is checked first; nothing is loaded.

    Raises:
        CheckpointError: naming the file, the field and the fix.
    """
    saved_groups = _saved_groups(saved, path, len(hf_order))
    group_of = {hf_order[i]: g for g, group in enumerate(saved_groups) for i in group["params"]}
    position = {name: i for i, name in enumerate(hf_order)}
    state, new_groups = {}, []
    for g, group in enumerate(groups):
        sources = set()
        for name in group["params"]:
            if name in group_of:
                sources.add(group_of[name])
                i = position[name]
                if i in saved["state"]:
                    _check_entry(path, name, i, saved["state"][i], shapes[name])
                    state[name] = saved["state"][i]
        hyper = {k: v for k, v in group.items() if k != "params"}
        for s in sorted(sources):
            _check_same_optimizer(path, s, saved_groups[s], hyper, optimizer_name)
        for k in hyper:
            for s in sorted(sources):
                if k in saved_groups[s]:
                    _check_hyperparameter(path, f"param_groups[{s}].{k}", saved_groups[s][k], hyper[k])
        if len(sources) > 1 and len({repr({k: saved_groups[s].get(k) for k in hyper}) for s in sources}) > 1:
            raise _refuse(path, "param_groups", f"give different hyperparameters to parameters this run's group {g} "
                          "holds together", "build the optimizer with Hugging Face's groups (the Trainer's own: "
                          "with and without weight decay), or delete optimizer.pt to resume with a fresh optimizer")
        if sources:
            source = saved_groups[min(sources)]
            hyper.update({k: source[k] for k in hyper if k in source and k not in _IMPLEMENTATION_FIELDS})
        new_groups.append({**hyper, "params": list(group["params"])})
    return {"state": state, "param_groups": new_groups}


def _same_shape(path: Path, field: str, saved: Any, current: Any) -> None:
    """``saved`` has the structure of this scheduler's own state: same keys, lengths and kinds of value."""
    if isinstance(current, dict):
        if not isinstance(saved, dict):
            raise _refuse(path, field, f"is {describe(saved)}, not a dict", _FIX_SCHEDULER)
        extra = [k for k in saved if k not in current]
        missing = [k for k in current if k not in saved and not (field == "the state" and k in _SCHEDULER_OPTIONAL)]
        if extra or missing:
            words = [f"has keys this scheduler lacks: {', '.join(map(describe, extra))}" if extra else "",
                     f"lacks keys: {', '.join(map(describe, missing))}" if missing else ""]
            raise _refuse(path, field, " and ".join(w for w in words if w), _FIX_SCHEDULER)
        for key in saved:
            _same_shape(path, f"{describe(key)}" if field == "the state" else f"{field}[{describe(key)}]",
                        saved[key], current[key])
    elif isinstance(current, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
            raise _refuse(path, field, f"is {describe(saved)}, not {len(current)} values (one per param group)",
                          _FIX_SCHEDULER)
        for i, (s, c) in enumerate(zip(saved, current)):
            _same_shape(path, f"{field}[{i}]", s, c)
    elif isinstance(current, bool) or current is None:
        if not (isinstance(saved, bool) or saved is None):
            raise _refuse(path, field, f"is {describe(saved)}, not a flag", _FIX_SCHEDULER)
    elif _number(current):
        # NOTE: infinity is a value some schedulers hold (ReduceLROnPlateau's best before any metric); NaN is not
        if not _number(saved) or math.isnan(saved) or (isinstance(current, int) and not isinstance(saved, int)):
            kind = "an integer" if isinstance(current, int) else "a number"
            raise _refuse(path, field, f"is {describe(saved)}, not {kind}", _FIX_SCHEDULER)
    elif type(saved) is not type(current):
        raise _refuse(path, field, f"is {describe(saved)}, not a {type(current).__name__}", _FIX_SCHEDULER)


def _expected_scheduler_state(saved: Any, own: dict) -> dict:
    """This scheduler's state as the file may hold it: a LambdaLR saves ``None`` for a plain function (nothing to
    restore) and the ``__dict__`` of a callable object or partial, so a schedule written as a function (Hugging
    Face's constant one) and read as a partial, or the reverse with an empty ``__dict__``, holds the same."""
    lambdas, mine = (saved.get("lr_lambdas") if isinstance(saved, dict) else None), own.get("lr_lambdas")
    if isinstance(lambdas, list) and isinstance(mine, list) and len(lambdas) == len(mine):
        own = {**own, "lr_lambdas": [s if s is None or (m is None and s == {}) else m for s, m in zip(lambdas, mine)]}
    return own


def checked_scheduler_state(saved: Any, path: Path, scheduler: Any) -> dict:
    """``saved`` checked against ``scheduler``'s own ``state_dict()`` (keys, per-group lengths, kinds) and ranges
    (steps >= 0, learning rates >= 0); the scheduler is not touched.

    Raises:
        CheckpointError: naming the file, the field and the fix.
    """
    _same_shape(path, "the state", saved, _expected_scheduler_state(saved, scheduler.state_dict()))
    for key in ("last_epoch", "_step_count"):
        if key in saved and saved[key] < 0:
            raise _refuse(path, describe(key), f"is {saved[key]}, below 0", _FIX_SCHEDULER)
    for key in ("base_lrs", "_last_lr", "min_lrs"):
        values = saved.get(key)
        if isinstance(values, (list, tuple)) and any(_number(v) and not 0 <= v < math.inf for v in values):
            raise _refuse(path, describe(key), f"is {describe(values)}: a learning rate below 0 or infinite",
                          _FIX_SCHEDULER)
    return saved
