"""Optimizers from optional packages, by Hugging Face's names: GaLore, GrokAdamW and schedule-free.

Each factory imports its package only when called, so a missing package is an error naming the package
and the extra (``pip install shardkit[optimizers]``) at the moment the optimizer is built, never at import.
Factories that need the model (GaLore picks its target ``nn.Linear`` weights) name a ``model`` keyword;
the registry passes it (see :func:`shardkit.optim.registry.create_optimizer`).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from shardkit.utils.operations import json_object

__all__ = ["GaLoreTargetError", "MissingOptimizerPackage", "NAMED_FACTORIES", "OptimizerUnsupportedError",
           "galore_projected_parameters", "galore_target_parameters", "is_galore", "is_grokadamw", "is_schedule_free",
           "parse_optim_args"]

EXTRA_HINT = "pip install shardkit[optimizers]"
logger = logging.getLogger("shardkit.optim")


class MissingOptimizerPackage(ImportError):
    """An optimizer's optional package is not installed; the message names the package and the extra."""


class OptimizerUnsupportedError(ValueError):
    """An optimizer cannot run here (this device, this strategy); the message says why and what to use."""


class GaLoreTargetError(ValueError):
    """``optim_target_modules`` matched nothing, or named a module that is not an ``nn.Linear``."""


def _import(module: str, package: str, optim: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingOptimizerPackage(f"optim={optim!r} needs the package {package!r} (import {module}), which is "
                                      f"not installed: {EXTRA_HINT} (or pip install {package})") from err


def parse_optim_args(value: Any) -> dict[str, Any]:
    """``optim_args`` as a dict: a dict as given, HF's ``"rank=64,update_proj_gap=200"``, or a JSON object.

    Values of the string form become int, float or bool where they read as one (``"0.25"`` -> 0.25).
    """
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    text = str(value).strip()
    if text.startswith("{"):
        return json_object(text, f"optim_args={text!r}", "pass a dict, a JSON object or 'key=value,key=value'")
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"optim_args={text!r}: {item!r} is not key=value; use e.g. 'rank=64,scale=0.25'")
        out[key.strip()] = _literal(raw.strip())
    return out


def _literal(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


# ---- GaLore ---------------------------------------------------------------------------------------


def _target_match(targets: str | list[str], name: str) -> tuple[bool, bool]:
    """(matched, by a regex) with Hugging Face's rules: a string is a full-match regex; a list entry matches
    the name exactly, as a substring, or as a full-match regex."""
    if isinstance(targets, str):
        return bool(re.fullmatch(targets, name)), targets != name
    if name in targets or any(t in name for t in targets):
        return True, False
    if any(re.fullmatch(t, name) for t in targets):
        return True, True
    return False, False


def _choose_linear(model: nn.Module, targets: str | list[str], optim: str) -> tuple[list[nn.Module], list[str]]:
    """The matched nn.Linear modules, and the non-Linear modules named without a regex (warned and skipped)."""
    all_linear = isinstance(targets, str) and targets.replace("_", "-").lower() == "all-linear"
    chosen, skipped = [], []
    for name, module in model.named_modules():
        found, by_regex = (False, False) if all_linear else _target_match(targets, name)
        if not isinstance(module, nn.Linear):
            if found and not by_regex and name:
                skipped.append(f"{name} ({type(module).__name__})")
            continue
        if found or all_linear:
            chosen.append(module)
    if skipped:
        logger.warning(f"optim={optim!r}: optim_target_modules matched {', '.join(skipped[:6])}"
                       f"{' ...' if len(skipped) > 6 else ''}, which are not nn.Linear: skipped (GaLore projects "
                       "nn.Linear weights only)")
    return chosen, skipped


def galore_target_parameters(model: nn.Module, targets: str | Sequence[str] | None,
                             optim: str = "galore_adamw") -> list[nn.Parameter]:
    """The weights of the ``nn.Linear`` modules ``targets`` names, by Hugging Face's rules: a string is a
    full-match regex on module names (``"all-linear"``: every Linear); a list entry matches a name exactly, as a
    substring, or as a full-match regex. Non-Linear matches are skipped (named in a warning when matched without
    a regex). A string of comma-separated plain names that matches nothing as a regex is read as that list (what
    ``--optim_target_modules q_proj,v_proj`` gives).

    Raises:
        GaLoreTargetError: no targets, or no nn.Linear matched (the skipped modules and some Linear names listed).
    """
    if not targets:
        raise GaLoreTargetError(f"optim={optim!r} needs TrainingArguments.optim_target_modules: a list of module "
                                "names, a regex, or 'all-linear'")
    targets = targets if isinstance(targets, str) else list(targets)
    for pattern in [targets] if isinstance(targets, str) else targets:
        try:
            re.compile(pattern)
        except re.error as err:
            raise GaLoreTargetError(f"optim_target_modules entry {pattern!r} is not a valid regex ({err})") from err
    chosen, skipped = _choose_linear(model, targets, optim)
    if not chosen and isinstance(targets, str) and re.fullmatch(r"[\w.]+(\s*,\s*[\w.]+)*", targets):
        chosen, skipped = _choose_linear(model, [t.strip() for t in targets.split(",")], optim)
    if not chosen:
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:8]
        also = f" (it matched only non-Linear modules: {', '.join(skipped[:6])})" if skipped else ""
        raise GaLoreTargetError(f"optim_target_modules={targets!r} matched no nn.Linear module of "
                                f"{type(model).__name__}{also}; its Linear modules include {linear}")
    return [m.weight for m in chosen if m.weight.requires_grad]


def _galore_groups(params: Iterable[Any], targets: list[nn.Parameter], galore: dict[str, Any]) -> list[dict]:
    """Split each given group into its GaLore weights (with rank & co) and the rest."""
    wanted = {id(p) for p in targets}
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        plist = list(group["params"])
        rest = {k: v for k, v in group.items() if k != "params"}
        low = [p for p in plist if id(p) in wanted]
        full = [p for p in plist if id(p) not in wanted]
        if low:
            out.append({**rest, "params": low, **galore})
        if full:
            out.append({**rest, "params": full})
    return out


def galore_projected_parameters(param_groups: Iterable[dict[str, Any]]) -> list[torch.Tensor]:
    """The parameters of GaLore's projected groups (those with a ``rank``)."""
    return [p for group in param_groups if "rank" in group for p in group["params"]]


class _ProjectorState:
    """Mixin: a GaLore optimizer whose state_dict holds tensors only (the projector's orthogonal matrix),
    so it saves in shardkit's checkpoint format and resumes exactly."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for index, live in saved["state"].items():
            if not isinstance(live, dict) or "projector" not in live:
                continue
            entry = {k: v for k, v in live.items() if k != "projector"}  # torch's state_dict shares the live dicts
            saved["state"][index] = entry
            projector = live["projector"]
            if projector.ortho_matrix is not None:
                ortho = projector.ortho_matrix
                pieces = ortho if isinstance(ortho, (list, tuple)) else [ortho]
                for i, piece in enumerate(pieces):
                    entry[f"galore_ortho_{i}"] = piece
        return saved

    def low_rank_state_parameters(self) -> list[torch.Tensor]:
        """The parameters whose moments live in GaLore's projected shape (rank x n), not the parameter's: the
        checkpoint reader's shape check leaves them out."""
        return galore_projected_parameters(self.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        # The package's SVD returns a strided view; a loaded matrix is contiguous, and a matmul on another
        # layout rounds differently. Contiguous here (the same values) keeps a resumed run bit-exact.
        for state in self.state.values():
            projector = state.get("projector")
            ortho = getattr(projector, "ortho_matrix", None)
            if isinstance(ortho, torch.Tensor):
                projector.ortho_matrix = ortho.contiguous()
            elif isinstance(ortho, (list, tuple)):
                projector.ortho_matrix = [o.contiguous() for o in ortho]
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        from galore_torch.galore_projector import GaLoreProjector

        for group in self.param_groups:
            if "rank" not in group:
                continue
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "galore_ortho_0" not in state:
                    continue
                pieces = [state.pop(k) for k in sorted(k for k in list(state) if k.startswith("galore_ortho_"))]
                projector = GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"],
                                            scale=group["scale"], proj_type=group["proj_type"])
                projector.ortho_matrix = pieces if group["proj_type"] == "full" else pieces[0]
                state["projector"] = projector


def _galore_class(kind: str, optim: str) -> type[Optimizer]:
    galore = _import("galore_torch", "galore-torch", optim)
    if kind == "adamw_8bit":
        if not torch.cuda.is_available():
            raise OptimizerUnsupportedError(f"optim={optim!r} steps with bitsandbytes' 8-bit kernels, which need a "
                                            "CUDA GPU (bitsandbytes 0.50 has no CPU path for them): use galore_adamw")
        _import("bitsandbytes", "bitsandbytes", optim)
        base = galore.GaLoreAdamW8bit
    else:
        base = {"adamw": galore.GaLoreAdamW, "adafactor": galore.GaLoreAdafactor}[kind]
    name = {"adamw": "GaLoreAdamW", "adafactor": "GaLoreAdafactor"}.get(kind, "GaLoreAdamW8bit")
    return type(name, (_ProjectorState, base), {"__module__": __name__})


def _galore(kind: str):
    optim = f"galore_{kind}"

    def factory(params: Iterable[Any], *, model: nn.Module, optim_target_modules: Any = None, rank: int = 128,
                update_proj_gap: int = 200, scale: float = 0.25, proj_type: str = "std", **kwargs: Any) -> Optimizer:
        cls = _galore_class(kind, optim)
        targets = galore_target_parameters(model, optim_target_modules, optim)
        galore = {"rank": int(rank), "update_proj_gap": int(update_proj_gap), "scale": float(scale),
                  "proj_type": str(proj_type)}
        if kind == "adafactor":  # HF's settings: an explicit lr, no relative step
            kwargs.setdefault("scale_parameter", False)
            kwargs.setdefault("relative_step", False)
        elif kind == "adamw":
            kwargs.setdefault("no_deprecation_warning", True)  # the package's AdamW warns on every build
        return cls(_galore_groups(params, targets, galore), **kwargs)

    factory.__name__ = optim
    return factory


def is_galore(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` projects some group's gradients GaLore's way (a group with ``rank``)."""
    return any("rank" in g and "update_proj_gap" in g for g in optimizer.param_groups)


# ---- GrokAdamW ------------------------------------------------------------------------------------


def _grokadamw(params: Iterable[Any], **kwargs: Any) -> Optimizer:
    package = _import("grokadamw", "grokadamw", "grokadamw")

    class GrokAdamW(package.GrokAdamW):
        """The package's GrokAdamW with its per-parameter state in ``self.state`` (the package keeps it in
        ``param_group["state"]``, keyed by tensors, which no state_dict can save or restore). The update is
        the package's; the Trainer sets ``param_group["train_loss"]`` (and ``"eval_loss"``) it reads."""

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                group["state"] = {p: self.state[p] for p in group["params"] if p in self.state}
            try:
                return super().step(closure)
            finally:
                for group in self.param_groups:
                    for p, value in group.pop("state", {}).items():
                        self.state[p] = value

    GrokAdamW.__module__ = __name__
    return GrokAdamW(params, **kwargs)


def is_grokadamw(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` reads the training loss from its param groups (GrokAdamW)."""
    return any("grokking_signal_fns" in g for g in optimizer.param_groups)


# ---- schedule-free ---------------------------------------------------------------------------------


def _schedule_free(cls_name: str, optim: str, warmup: bool):
    def factory(params: Iterable[Any], *, training_args: Any = None, **kwargs: Any) -> Optimizer:
        package = _import("schedulefree", "schedulefree", optim)
        if warmup and training_args is not None:
            kwargs.setdefault("warmup_steps", int(training_args.warmup_steps))  # as HF: its own linear warmup
        return getattr(package, cls_name)(params, **kwargs)

    factory.__name__ = optim
    return factory


def is_schedule_free(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` keeps two points (y for gradients, x to evaluate) switched by train()/eval()."""
    return callable(getattr(optimizer, "eval", None)) and all("train_mode" in g for g in optimizer.param_groups)


NAMED_FACTORIES = {
    "galore_adamw": _galore("adamw"),
    "galore_adamw_8bit": _galore("adamw_8bit"),
    "galore_adafactor": _galore("adafactor"),
    "grokadamw": _grokadamw,
    "schedule_free_adamw": _schedule_free("AdamWScheduleFree", "schedule_free_adamw", True),
    "schedule_free_sgd": _schedule_free("SGDScheduleFree", "schedule_free_sgd", True),
    "schedule_free_radam": _schedule_free("RAdamScheduleFree", "schedule_free_radam", False),
}
