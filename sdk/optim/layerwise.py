"""Layer-wise optimizers: one optimizer per parameter, stepped the moment its gradient is complete.

``optim="galore_adamw_layerwise"`` / ``"galore_adafactor_layerwise"`` / ``"galore_adamw_8bit_layerwise"``
(package galore-torch, as Hugging Face names them): each trainable parameter gets its own GaLore
optimizer, stepped and its gradient freed from ``register_post_accumulate_grad_hook``, so at most one
parameter's gradient is alive at a time.

HF's Trainer drives this with a dummy optimizer and a dummy scheduler wrapping per-parameter schedulers.
Here one :class:`LayerwiseOptimizer` stands for all of them: its ``param_groups`` ARE the inner
optimizers' groups (the same dicts), so any ordinary LR scheduler built over it sets every inner
optimizer's ``lr``; its ``step()`` does nothing (the hooks stepped already), so the Runner's step at the
end of the window only steps the scheduler and clears gradients. ``state_dict()`` gathers the inner
optimizers' states as one torch-format state dict (GaLore's projector saved as its matrix), so a
checkpoint resumes exactly.

Because each parameter steps before the others' gradients exist, gradients can neither accumulate over
micro-batches nor be all-reduced first, and the total norm cannot be clipped: the Trainer refuses
``gradient_accumulation_steps > 1`` and any strategy but one process (see
:mod:`shardkit.trainer.backward_step`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .named import (
    MissingOptimizerPackage,
    OptimizerUnsupportedError,
    galore_projected_parameters,
    galore_target_parameters,
)
from .registry import register_optimizer

__all__ = ["LayerwiseOptimizer"]

_EXTRA_HINT = "pip install shardkit[optimizers]"
_ORTHO = "galore_ortho_"


class LayerwiseOptimizer(Optimizer):
    """One inner optimizer per trainable parameter, each stepped from that parameter's gradient hook.

    Args:
        params: parameters or param groups; every option of a group reaches the inner optimizers of its
            parameters (``weight_decay``, GaLore's ``rank`` ...).
        make: ``make([group]) -> Optimizer`` builds the inner optimizer of one single-parameter group.
    """

    def __init__(self, params: Iterable[Any], make: Callable[[list[dict[str, Any]]], Optimizer]):
        items = list(params)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
        self.optimizers: list[Optimizer] = []
        self._params: list[torch.Tensor] = []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.requires_grad:
                    self.optimizers.append(make([{**options, "params": [p]}]))
                    self._params.append(p)
        if not self._params:
            raise ValueError("LayerwiseOptimizer got no trainable parameter")
        super().__init__([{"params": [p]} for p in self._params], {})
        self._link_groups()
        self._by_param = dict(zip(self._params, self.optimizers))
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def _link_groups(self) -> None:
        # The same dicts as the inner optimizers': an LR scheduler over this optimizer sets theirs.
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers]

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        inner = self._by_param[p]
        inner.step()
        inner.zero_grad(set_to_none=True)
        _contiguous_projector(inner.state.get(p))

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:  # type: ignore[override]
        """Every inner optimizer's state, by parameter (the inner optimizers own it)."""
        return {p: opt.state[p] for p, opt in zip(self._params, self.optimizers) if p in opt.state}

    @state.setter
    def state(self, value: Any) -> None:
        pass  # torch's Optimizer.__init__ assigns an empty state; the inner optimizers hold the real one

    def low_rank_state_parameters(self) -> list[torch.Tensor]:
        """The parameters whose moments live in GaLore's projected shape (the checkpoint reader's shape check
        leaves them out)."""
        return galore_projected_parameters(self.param_groups)

    def step(self, closure: Any = None) -> Any:
        """Nothing to do: every parameter stepped in its gradient hook. Returns the closure's loss, if any."""
        return closure() if closure is not None else None

    def state_dict(self) -> dict[str, Any]:
        """A torch-format state dict: group ``i`` and state ``i`` are parameter ``i``'s inner optimizer's."""
        groups, state = [], {}
        for index, opt in enumerate(self.optimizers):
            inner = opt.state_dict()
            groups.append({**inner["param_groups"][0], "params": [index]})
            if 0 in inner["state"]:
                state[index] = _plain_state(inner["state"][0])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, one inner optimizer per saved group."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"the saved layer-wise optimizer has {len(saved)} parameters, this one "
                             f"{len(self.optimizers)}: the model or its trainable parameters changed since the save")
        for p, opt, group in zip(self._params, self.optimizers, saved):
            (index,) = group["params"]
            entry = state_dict["state"].get(index)
            opt.load_state_dict({"state": {0: dict(entry)} if entry else {},
                                 "param_groups": [{**group, "params": [0]}]})
            if entry:
                _restore_projector(opt.state[p], opt.param_groups[0])
        self._link_groups()


def _plain_state(entry: dict[str, Any]) -> dict[str, Any]:
    """A copy of one parameter's state with GaLore's projector object replaced by its matrices."""
    out = dict(entry)  # a copy: torch's state_dict hands out the live dicts
    projector = out.pop("projector", None)
    if projector is not None and projector.ortho_matrix is not None:
        ortho = projector.ortho_matrix
        for i, piece in enumerate(ortho if isinstance(ortho, (list, tuple)) else [ortho]):
            out[f"{_ORTHO}{i}"] = piece
    return out


def _restore_projector(state: dict[str, Any], group: dict[str, Any]) -> None:
    keys = sorted(k for k in state if k.startswith(_ORTHO))
    if not keys:
        return
    from galore_torch.galore_projector import GaLoreProjector

    pieces = [state.pop(k) for k in keys]
    projector = GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                                proj_type=group["proj_type"])
    projector.ortho_matrix = pieces if group["proj_type"] == "full" else pieces[0]
    state["projector"] = projector


def _contiguous_projector(state: dict[str, Any] | None) -> None:
    """Keep GaLore's projection matrix contiguous, as it is when a checkpoint restores it.

    ``torch.linalg.svd`` returns column-major factors, so the projector's slice of them is strided; a
    matmul with a strided and with a contiguous operand can round differently, and a resumed run (whose
    matrix came back contiguous from the checkpoint) would drift from the uninterrupted one by ulps.
    """
    projector = state.get("projector") if state else None
    ortho = getattr(projector, "ortho_matrix", None)
    if isinstance(ortho, torch.Tensor):
        projector.ortho_matrix = ortho.contiguous()
    elif isinstance(ortho, (list, tuple)):
        projector.ortho_matrix = [piece.contiguous() for piece in ortho]


# ---- GaLore's layer-wise rows ------------------------------------------------------------------------


def _galore_base(kind: str, optim: str) -> type[Optimizer]:
    try:
        galore = importlib.import_module("galore_torch")
    except ImportError as err:
        raise MissingOptimizerPackage(f"optim={optim!r} needs the package 'galore-torch' (import galore_torch), "
                                      f"which is not installed: {_EXTRA_HINT} (or pip install galore-torch)") from err
    if kind == "adamw_8bit":
        if not torch.cuda.is_available():
            # galore-torch's AdamW8bit.step() calls torch.cuda.synchronize() and bitsandbytes' 8-bit kernels.
            raise OptimizerUnsupportedError(f"optim={optim!r} steps with bitsandbytes' 8-bit kernels, which need a "
                                            "CUDA GPU (galore-torch's AdamW8bit calls torch.cuda.synchronize): use "
                                            "galore_adamw_layerwise on a CPU")
        return galore.GaLoreAdamW8bit
    return {"adamw": galore.GaLoreAdamW, "adafactor": galore.GaLoreAdafactor}[kind]


def _galore_layerwise(kind: str):
    optim = f"galore_{kind}_layerwise"

    def factory(params: Iterable[Any], *, model: nn.Module | None = None, optim_target_modules: Any = None,
                rank: int = 128, update_proj_gap: int = 200, scale: float = 0.25, proj_type: str = "std",
                **kwargs: Any) -> Optimizer:
        if model is None:
            raise ValueError(f"optim={optim!r} picks its GaLore weights from the model: create_optimizer({optim!r}, "
                             "params, context={'model': model, 'optim_target_modules': [...]})")
        base = _galore_base(kind, optim)
        targets = {id(p) for p in galore_target_parameters(model, optim_target_modules, optim)}
        galore = {"rank": int(rank), "update_proj_gap": int(update_proj_gap), "scale": float(scale),
                  "proj_type": str(proj_type)}
        if kind == "adafactor":  # HF's settings: an explicit lr, no relative step
            kwargs.setdefault("scale_parameter", False)
            kwargs.setdefault("relative_step", False)
        if kind == "adamw":
            kwargs.setdefault("no_deprecation_warning", True)  # one warning per parameter otherwise

        def make(group: list[dict[str, Any]]) -> Optimizer:
            (only,) = group
            extra = galore if id(only["params"][0]) in targets else {}
            return base([{**only, **extra}], **kwargs)

        return LayerwiseOptimizer(params, make)

    factory.__name__ = optim
    return factory


for _kind in ("adamw", "adafactor", "adamw_8bit"):
    register_optimizer(f"galore_{_kind}_layerwise", _galore_layerwise(_kind))
