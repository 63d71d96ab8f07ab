"""Optimizer state keyed by parameter name, so it survives re-wrapping and re-ordering of parameters."""

from __future__ import annotations

from typing import Any

import torch

from .format import CheckpointError

__all__ = ["load_optimizer_state_by_name", "optimizer_state_by_name"]


def _ids_to_names(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                  groups: list[dict[str, Any]]) -> dict[int, str]:
    """Maps the integer ids of ``optimizer.state_dict()`` to parameter FQNs of ``module``."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    out: dict[int, str] = {}
    for gi, (live, saved) in enumerate(zip(optimizer.param_groups, groups)):
        for p, pid in zip(live["params"], saved["params"]):
            name = names.get(id(p))
            if name is None:
                raise CheckpointError(
                    f"optimizer param_groups[{gi}] holds a parameter of shape {list(p.shape)} that is not in "
                    f"{type(module).__name__}.named_parameters(); pass the module the optimizer was built on")
            out[pid] = name
    return out


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, Any]:
    """Returns ``optimizer.state_dict()`` with parameter ids replaced by the module's parameter names.

    ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``; store it with
    ``CheckpointWriter.write_state``.

    Raises:
        CheckpointError: if an optimizer parameter is not a parameter of ``module``.
    """
    sd = optimizer.state_dict()
    id2name = _ids_to_names(optimizer, module, sd["param_groups"])
    groups = [{**g, "params": [id2name[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": {id2name[i]: s for i, s in sd["state"].items()}, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                                 nested: dict[str, Any]) -> None:
    """Loads state saved by :func:`optimizer_state_by_name` into ``optimizer``.

    Raises:
        CheckpointError: if the groups or the parameter names differ (naming the first one).
    """
    current = optimizer.state_dict()["param_groups"]
    saved = nested.get("param_groups")
    if not isinstance(saved, list) or not isinstance(nested.get("state"), dict):
        raise CheckpointError("optimizer state by name needs 'state' (dict) and 'param_groups' (list)")
    if len(saved) != len(current):
        raise CheckpointError(f"saved optimizer has {len(saved)} param groups, this optimizer has {len(current)}")
    id2name = _ids_to_names(optimizer, module, current)
    name2id = {n: i for i, n in id2name.items()}
    groups = []
    for gi, (cur, sav) in enumerate(zip(current, saved)):
        want = [id2name[i] for i in cur["params"]]
        want_set, sav_set = set(want), set(sav["params"])
        extra = [n for n in sav["params"] if n not in want_set]
        missing = [n for n in want if n not in sav_set]
        if extra or missing:
            what = (f"saved parameter {extra[0]!r} is not in this group" if extra
                    else f"parameter {missing[0]!r} has no saved entry")
            raise CheckpointError(f"optimizer param_groups[{gi}]: {what} ({len(extra)} extra, {len(missing)} "
                                  "missing); the model or the optimizer's groups changed since the save")
        # NOTE: torch maps saved ids to live params by position, so the live ids in live order make it exact.
        groups.append({**sav, "params": list(cur["params"])})
    state = {}
    params = dict(module.named_parameters())
    # An optimizer that keeps some parameters' moments in a projected, smaller shape (GaLore) names them.
    low_rank = {id(p) for p in getattr(optimizer, "low_rank_state_parameters", list)()}
    for name, st in nested["state"].items():
        if name not in name2id:
            raise CheckpointError(f"saved optimizer state for {name!r}, which is not a parameter of this optimizer")
        if id(params[name]) not in low_rank:
            _check_state_shapes(name, st, params[name])
        state[name2id[name]] = st
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# State that torch's and shardkit's optimizers keep element for element beside the parameter (Adam/AdamW,
# SGD, RMSprop, Adagrad, Adadelta, Adamax, FusedAdamW's fp32 master). Others (factored second moments, 8-bit
# blocks, scalars) have shapes of their own and are not compared.
_PER_ELEMENT = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                          "grad_avg", "sum", "exp_inf", "master_param"})


def _check_state_shapes(name: str, st: Any, param: torch.Tensor) -> None:
    """Refuses a saved state tensor whose shape is not its parameter's, at load rather than at the first step
    (where torch's message names neither the parameter nor the checkpoint)."""
    if not isinstance(st, dict):
        raise CheckpointError(f"saved optimizer state for {name!r} is a {type(st).__name__}, not a dict of values")
    for key, value in st.items():
        if key in _PER_ELEMENT and isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(f"saved optimizer state {key!r} of parameter {name!r} has shape "
                                  f"{list(value.shape)}, but the parameter has shape {list(param.shape)}; the model "
                                  "changed since the save, or the checkpoint belongs to another model")
