"""Schema checks for the objects in DeepSpeed's ZeRO checkpoint files, after the allowlist unpickler read them.

The unpickler guarantees what the objects are made of (tensors no larger than their storage, plain
containers, numbers, strings); these checks say what a ZeRO file must hold, so the planner that follows
never meets a wrong type (a bare ``KeyError``/``TypeError``) or a count that asks for unbounded work (a
``partition_count`` of 10**9 would build a billion file names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .schema import Fields

__all__ = ["MAX_GROUPS", "MAX_RANKS", "check_model_states", "check_optimizer_states"]

MAX_RANKS = 1 << 20  # more ranks than any job has run; a larger count is an edit
MAX_GROUPS = 1 << 16
_MAX_DIMS = 64
_ADVICE = "the DeepSpeed checkpoint is corrupt or was edited; restore it from a copy or save it again"


class _DSFields(Fields):
    """Fields of one DeepSpeed file."""

    def __init__(self, file: Path) -> None:
        super().__init__(file, _ADVICE)

    def list_(self, v: Any, field: str, most: int = MAX_GROUPS) -> list:
        if not isinstance(v, (list, tuple)) or len(v) > most:
            raise self.fail(field, f"must be a list of at most {most} items, got {type(v).__name__}")
        return list(v)

    def tensor(self, v: Any, field: str) -> torch.Tensor:
        if not isinstance(v, torch.Tensor):
            raise self.fail(field, f"must be a tensor, got {type(v).__name__}")
        return v

    def shape(self, v: Any, field: str) -> torch.Size:
        dims = self.list_(v, field, _MAX_DIMS)
        return torch.Size([self.int_(d, f"{field}[{i}]", hi=1 << 62) for i, d in enumerate(dims)])

    def names(self, v: Any, field: str) -> list[str]:
        return [self.str_(x, f"{field}[{i}]") for i, x in enumerate(self.list_(v, field, 1 << 24))]

    def shapes(self, v: Any, field: str) -> dict[str, torch.Size]:
        return {self.str_(k, field): self.shape(s, f"{field}.{k}") for k, s in self.obj(v, field).items()}


def check_optimizer_states(obj: Any, file: Path) -> dict[str, Any]:
    """Validates one ``*_optim_states.pt``; returns its ``optimizer_state_dict`` with ``partition_count`` an int,
    ``zero_stage`` an int and the flat fp32 groups under ``"groups"``."""
    f = _DSFields(file)
    osd = f.obj(f.get(f.obj(obj, "(the whole file)"), "optimizer_state_dict", ""), "optimizer_state_dict")
    stage = f.int_(f.get(osd, "zero_stage", "optimizer_state_dict"), "optimizer_state_dict.zero_stage", 1, 3)
    count = f.get(osd, "partition_count", "optimizer_state_dict")
    where = "optimizer_state_dict.partition_count"
    counts = ([f.int_(c, f"{where}[{i}]", 1, MAX_RANKS) for i, c in enumerate(f.list_(count, where))]
              if isinstance(count, (list, tuple)) else [f.int_(count, where, 1, MAX_RANKS)])
    if not counts:
        raise f.fail(where, "is an empty list")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    field = f"optimizer_state_dict.{key}"
    groups = [f.tensor(t, f"{field}[{i}]") for i, t in enumerate(f.list_(f.get(osd, key, "optimizer_state_dict"),
                                                                          field))]
    paddings = osd.get("param_alignment_paddings")
    if paddings is not None:
        field = "optimizer_state_dict.param_alignment_paddings"
        paddings = [[f.int_(p, f"{field}[{g}][{i}]", hi=1 << 40) for i, p in enumerate(f.list_(row, f"{field}[{g}]",
                                                                                                 1 << 24))]
                    for g, row in enumerate(f.list_(paddings, field))]
    return {"zero_stage": stage, "partition_count": max(counts), "groups": groups, "paddings": paddings}


def check_model_states(obj: Any, file: Path) -> dict[str, Any]:
    """Validates one ``*_model_states.pt``; returns the fields the planner reads, with their types checked."""
    f = _DSFields(file)
    top = f.obj(obj, "(the whole file)")
    module = top.get("module") or {}
    module = {f.str_(k, "module"): f.tensor(v, f"module.{k}") for k, v in f.obj(module, "module").items()}
    shapes = f.list_(f.get(top, "param_shapes", ""), "param_shapes")
    out = {
        "module": module,
        "buffer_names": f.names(f.get(top, "buffer_names", ""), "buffer_names"),
        "param_shapes": [f.shapes(g, f"param_shapes[{i}]") for i, g in enumerate(shapes)],
        "frozen_param_shapes": None, "frozen_param_fragments": {}, "shared_params": {},
        "ds_version": top.get("ds_version") if isinstance(top.get("ds_version"), str) else None,
    }
    if top.get("frozen_param_shapes") is not None:
        out["frozen_param_shapes"] = f.shapes(top["frozen_param_shapes"], "frozen_param_shapes")
        frags = f.obj(top.get("frozen_param_fragments") or {}, "frozen_param_fragments")
        out["frozen_param_fragments"] = {f.str_(k, "frozen_param_fragments"): f.tensor(v, f"frozen_param_fragments."
                                                                                         f"{k}")
                                         for k, v in frags.items()}
    shared = f.obj(top.get("shared_params") or {}, "shared_params")
    out["shared_params"] = {f.str_(k, "shared_params"): f.str_(v, f"shared_params.{k}") for k, v in shared.items()}
    return out
