"""Mixture-of-experts weights between the stacked layout models hold and the per-expert layout HF files keep.

transformers 5 holds a Qwen2-MoE / Qwen3-MoE / Mixtral expert block as two stacked tensors, ``experts.gate_up_proj``
(E, 2I, H) (gate rows first, then up rows) and ``experts.down_proj`` (E, H, I), as shardkit's MoE does. Its
``save_pretrained`` writes them back in the per-expert layout of the Hub's checkpoints, which transformers 4,
vLLM and every other reader of those models expect:

* Qwen2-MoE, Qwen3-MoE, GLM4-MoE: ``<p>.experts.<e>.gate_proj.weight`` (I, H), ``up_proj.weight`` (I, H),
  ``down_proj.weight`` (H, I);
* Mixtral: the same as ``w1`` (gate), ``w3`` (up), ``w2`` (down), and every ``.mlp.`` of the name is
  ``.block_sparse_moe.`` on disk (the router too).

:func:`layout_for` names the on-disk layout of a ``model_type``; :meth:`ExpertLayout.pieces` says where each
on-disk tensor comes from (a stacked tensor's box), so writers stream one expert at a time (``save_pretrained``,
``zero-to-fp32``). :func:`stacked_view` goes the other way for ``load_pretrained``: files in the per-expert layout
seen as the stacked tensors a model asks for. Other model types are written as the model holds them (transformers 5
loads those too).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .format import CheckpointError
from .trust import read_json_file

__all__ = ["ExpertLayout", "Piece", "export_plan", "layout_for", "model_type_of", "stacked_view"]

_MAX_CONFIG = 64 << 20
_STACKED = re.compile(r"^(?P<prefix>.*\.)?experts\.(?P<which>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<e>\d+)\.(?P<proj>[^.]+)\.weight$")


@dataclass(frozen=True)
class Piece:
    """One on-disk tensor: ``source[index]`` of the stacked (or plain) tensor named ``source``."""

    name: str
    source: str
    index: tuple[Any, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ExpertLayout:
    """A per-expert file layout: the gate, up and down projections' names and the MLP module's name on disk."""

    gate: str
    up: str
    down: str
    mlp_on_disk: str = "mlp"

    def rename(self, name: str) -> str:
        """A model name's on-disk spelling."""
        return name.replace(".mlp.", f".{self.mlp_on_disk}.") if self.mlp_on_disk != "mlp" else name

    def pieces(self, name: str, shape: tuple[int, ...]) -> list[Piece]:
        """The on-disk tensors the model's tensor ``name`` (of ``shape``) is written as: one per expert and
        projection for a stacked expert weight, else the tensor itself (renamed)."""
        m = _STACKED.match(name)
        whole = Piece(self.rename(name), name, (), tuple(shape))
        if m is None or len(shape) != 3:
            return [whole]
        prefix = self.rename(m.group("prefix") or "") + "experts."
        experts, rows, cols = shape
        if m.group("which") == "down_proj":
            return [Piece(f"{prefix}{e}.{self.down}.weight", name, (e,), (rows, cols)) for e in range(experts)]
        if rows % 2:
            raise CheckpointError(f"{name}: gate_up_proj of shape {list(shape)} has an odd row count; it is not "
                                  "(E, 2I, H) gate rows then up rows")
        half = rows // 2
        out = []
        for e in range(experts):
            out.append(Piece(f"{prefix}{e}.{self.gate}.weight", name, (e, slice(0, half)), (half, cols)))
            out.append(Piece(f"{prefix}{e}.{self.up}.weight", name, (e, slice(half, rows)), (half, cols)))
        return out

    def split(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(on-disk name, tensor)`` pairs for one of the model's tensors (views of it, no copies)."""
        return [(p.name, tensor[p.index] if p.index else tensor) for p in self.pieces(name, tuple(tensor.shape))]


_QWEN = ExpertLayout("gate_proj", "up_proj", "down_proj")
_MIXTRAL = ExpertLayout("w1", "w3", "w2", mlp_on_disk="block_sparse_moe")
# model_type -> the layout transformers 5's save_pretrained writes for it (its conversion mapping, reversed)
_LAYOUTS = {"qwen2_moe": _QWEN, "qwen3_moe": _QWEN, "glm4_moe": _QWEN, "mixtral": _MIXTRAL}


def layout_for(model_type: str | None) -> ExpertLayout | None:
    """The per-expert layout HF files keep for ``model_type``, or None where it is written as the model holds it."""
    return _LAYOUTS.get(model_type) if isinstance(model_type, str) else None


def model_type_of(export_dir: Path) -> str | None:
    """The ``model_type`` of the ``config.json`` in ``export_dir`` (None without one)."""
    config = export_dir / "config.json"
    if not config.is_file():
        return None
    raw = read_json_file(config, _MAX_CONFIG, "the model file config.json")
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    return kind if isinstance(kind, str) else None


class _StackedView:
    """An :class:`~shardkit.checkpoint.hf_reader.HFWeights` whose per-expert tensors also answer as the stacked
    names a model holds (each stacked tensor assembled when read), and renamed tensors under the model's names."""

    def __init__(self, weights: Any, stacked: dict[str, list[Piece]], renamed: dict[str, str]) -> None:
        self._weights = weights
        self._stacked = stacked
        self._renamed = renamed
        self.path = weights.path
        consumed = {p.name for pieces in stacked.values() for p in pieces} | set(renamed.values())
        # the files' per-expert names stand for the stacked ones: a strict load sees no key twice
        self.weight_map = {**{k: v for k, v in weights.weight_map.items() if k not in consumed},
                           **{k: weights.weight_map[p[0].name] for k, p in stacked.items()},
                           **{k: weights.weight_map[v] for k, v in renamed.items()}}

    def _disk(self, key: str) -> str:
        return self._stacked[key][0].name if key in self._stacked else self._renamed.get(key, key)

    def file_path(self, key: str) -> Any:
        return self._weights.file_path(self._disk(key))

    def shape(self, key: str) -> tuple[int, ...]:
        pieces = self._stacked.get(key)
        if pieces is None:
            return self._weights.shape(self._disk(key))
        for p in pieces:
            if self._weights.shape(p.name) != p.shape:
                raise CheckpointError(f"{self._weights.file_path(p.name)}: {p.name} has shape "
                                      f"{list(self._weights.shape(p.name))}, the model's {key} needs {list(p.shape)}")
        experts = 1 + max(p.index[0] for p in pieces)
        rows = sum(p.shape[0] for p in pieces if p.index[0] == 0)
        return (experts, rows, pieces[0].shape[1])

    def dtype(self, key: str) -> torch.dtype:
        pieces = self._stacked.get(key)
        if pieces is None:
            return self._weights.dtype(self._disk(key))
        dtypes = {self._weights.dtype(p.name) for p in pieces}
        if len(dtypes) != 1:
            raise CheckpointError(f"{self.path}: the experts stacked into {key} are stored in several dtypes "
                                  f"{sorted(map(str, dtypes))}")
        return dtypes.pop()

    def get(self, key: str) -> torch.Tensor:
        pieces = self._stacked.get(key)
        if pieces is None:
            return self._weights.get(self._disk(key))
        out = torch.empty(self.shape(key), dtype=self.dtype(key))
        for p in pieces:
            out[p.index] = self._weights.get(p.name)
        return out

    def read_flat(self, key: str, start: int, count: int) -> torch.Tensor:
        if key not in self._stacked:
            return self._weights.read_flat(self._disk(key), start, count)
        return self.get(key).reshape(-1)[start:start + count].clone()


def _experts_on_disk(have: Any, layout: ExpertLayout) -> dict[tuple[str, str], set[int]]:
    """(on-disk prefix ending in ``experts.``, projection) -> the expert indices the files hold in ``layout``."""
    found: dict[tuple[str, str], set[int]] = {}
    projections = {layout.gate, layout.up, layout.down}
    for key in have:
        m = _PER_EXPERT.match(key)
        if m is not None and m.group("proj") in projections:
            found.setdefault((m.group("prefix"), m.group("proj")), set()).add(int(m.group("e")))
    return found


def _check_expert_set(path: Any, name: str, shape: tuple[int, ...], layout: ExpertLayout, in_files: bool,
                      on_disk: dict[tuple[str, str], set[int]]) -> None:
    """A stacked weight's experts in the files must be all of the model's and no more, in one layout only: a file
    written for another ``num_experts``, or missing some experts, would otherwise load in part (strict=False) or fail
    on a list of names that hides the cause."""
    m = _STACKED.match(name)
    if m is None or len(shape) != 3:
        return
    prefix = layout.rename(m.group("prefix") or "") + "experts."
    projections = (layout.down,) if m.group("which") == "down_proj" else (layout.gate, layout.up)
    held = {proj: on_disk.get((prefix, proj), set()) for proj in projections}
    if not any(held.values()):
        return
    if in_files:
        proj = next(p for p in projections if held[p])
        raise CheckpointError(f"{path}: holds both the stacked {name} and per-expert tensors "
                              f"{prefix}{min(held[proj])}.{proj}.weight ...: it is ambiguous which one is the "
                              "model's; keep one layout")
    want = set(range(shape[0]))
    for proj, indices in held.items():
        if indices != want:
            missing, extra = sorted(want - indices), sorted(indices - want)
            raise CheckpointError(
                f"{path}: {prefix}<e>.{proj}.weight is stored for {len(indices)} experts, the model's {name} has "
                f"{shape[0]}" + (f"; missing experts {missing[:8]}" if missing else "")
                + (f"; experts {extra[:8]} beyond the model's" if extra else "")
                + ": the files were written for another num_experts, or are incomplete")


def stacked_view(weights: Any, model_keys: dict[str, tuple[int, ...]]) -> Any:
    """``weights`` as a model holding ``model_keys`` (name -> shape) reads it: where the files keep a stacked expert
    weight the model has in any known per-expert layout (and not stacked), that weight reads from its experts; a
    Mixtral file's ``.block_sparse_moe.`` names answer as ``.mlp.``. ``weights`` itself when nothing needs it.

    Raises:
        CheckpointError: per-expert tensors for other experts than the model's ``0 .. E-1`` (some missing, or more
            of them), or both the stacked and the per-expert form of one weight, whatever ``strict`` says.
    """
    have = weights.weight_map
    for layout in (_QWEN, _MIXTRAL):
        stacked = {}
        renamed = {}
        on_disk = _experts_on_disk(have, layout)
        for name, shape in model_keys.items():
            if on_disk:
                _check_expert_set(weights.path, name, shape, layout, name in have, on_disk)
            if name in have:
                continue
            pieces = layout.pieces(name, shape)
            if len(pieces) > 1 and all(p.name in have for p in pieces):
                stacked[name] = pieces
            elif len(pieces) == 1 and pieces[0].name != name and pieces[0].name in have:
                renamed[name] = pieces
        if stacked:
            return _StackedView(weights, stacked, {k: p[0].name for k, p in renamed.items()})
    return weights


def export_plan(keys: dict[str, tuple[tuple[int, ...], torch.dtype]], fetch: Callable[[str], torch.Tensor],
                layout: ExpertLayout | None) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
                                                      Callable[[str], torch.Tensor]]:
    """A writer's ``keys`` (name -> (shape, dtype)) and ``fetch`` as ``layout`` writes them (unchanged for None).

    The returned fetch reads each stacked tensor once for all of its experts: it keeps the last two read (a layer's
    gate_up_proj and down_proj), so memory stays near two stacked tensors whatever order the writer asks in."""
    if layout is None:
        return keys, fetch
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    where: dict[str, Piece] = {}
    for name, (shape, dtype) in keys.items():
        for p in layout.pieces(name, tuple(shape)):
            out[p.name] = (p.shape, dtype)
            where[p.name] = p
    recent: dict[str, torch.Tensor] = {}

    def fetch_piece(name: str) -> torch.Tensor:
        p = where[name]
        if p.source not in recent:
            if len(recent) == 2:
                recent.pop(next(iter(recent)))
            recent[p.source] = fetch(p.source)
        t = recent[p.source]
        return t[p.index] if p.index else t

    return out, fetch_piece
