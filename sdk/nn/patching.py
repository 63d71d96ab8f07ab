"""Patch Hugging Face transformers models in place to run on shardkit's fused ops.

``apply_fused_kernels(model)`` swaps, on ONE model instance:

- every ``*RMSNorm`` module's forward for :func:`shardkit.ops.rms_norm` (Gemma's ``(1 + weight)`` through
  ``offset=1.0``; Gemma normalises and scales in fp32 then casts once, which is what the op does);
- rotary application: the modeling module's ``apply_rotary_pos_emb`` becomes a gated wrapper around
  :func:`shardkit.ops.rope`. The module function is global to the family, so the wrapper only takes the fused
  path inside the forward of an attention module of a patched model (a context variable set by the patched
  attention forward) and calls the original everywhere else: an unpatched model in the same process, e.g. the
  oracle of a test, keeps HF's exact code;
- the gated MLP for :func:`shardkit.ops.swiglu` (SiLU: Llama, Mistral, Qwen2, Phi-3's fused ``gate_up_proj``,
  Mixtral's experts) or :func:`shardkit.ops.geglu` (Gemma's ``gelu_pytorch_tanh``): the per-family rules are in
  ``_mlp_patch.py``;
- the ``*ForCausalLM`` forward, so that with labels the loss goes through the fused linear cross-entropy and
  the (tokens, vocab) logits are never materialised (see ``_hf_loss.py``; ZeRO-3 gathers the head weight).

Patches are instance attributes bound with ``types.MethodType`` (never class attributes), so other instances
are untouched and ``copy.deepcopy`` of a patched model re-binds them to the copy.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import logging
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..ops import rms_norm, rope
from ._hf_loss import causal_lm_forward
from ._mlp_patch import activation_name, patch_gated_mlp

__all__ = ["SUPPORTED_MODEL_TYPES", "apply_fused_kernels", "supported_model_types"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Family:
    """Where a model type lives in transformers and how its RMSNorm is written."""

    module: str
    norm_offset: float = 0.0  # 1.0: Gemma's (1 + weight)
    # Llama-style norms return ``weight * x_normed.to(x.dtype)``: the result dtype follows promotion with the
    # weight's dtype; Gemma-style ones return ``(...).type_as(x)``.
    norm_promotes: bool = True


_M = "transformers.models"
_FAMILIES: dict[str, _Family] = {
    "llama": _Family(f"{_M}.llama.modeling_llama"),
    "mistral": _Family(f"{_M}.mistral.modeling_mistral"),
    "mixtral": _Family(f"{_M}.mixtral.modeling_mixtral"),
    "phi3": _Family(f"{_M}.phi3.modeling_phi3"),
    "qwen2": _Family(f"{_M}.qwen2.modeling_qwen2"),
    "gemma": _Family(f"{_M}.gemma.modeling_gemma", 1.0, False),
    "gemma2": _Family(f"{_M}.gemma2.modeling_gemma2", 1.0, False),
    "gemma3_text": _Family(f"{_M}.gemma3.modeling_gemma3", 1.0, False),
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILIES)

# Set to True for the duration of a patched attention module's forward; read by the rope wrapper.
_FUSED_ROPE: contextvars.ContextVar[bool] = contextvars.ContextVar("shardkit_fused_rope", default=False)


def supported_model_types() -> tuple[str, ...]:
    """The ``config.model_type`` values whose modeling module the installed transformers has."""
    out = []
    for name, fam in _FAMILIES.items():
        try:
            found = importlib.util.find_spec(fam.module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            out.append(name)
    return tuple(out)


# ---- RMSNorm -----------------------------------------------------------------------------------------------

def _rms_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    y = rms_norm(x, self.weight, self._shardkit_eps, self._shardkit_offset)
    if self._shardkit_promotes and self.weight.dtype != x.dtype:
        y = y.to(torch.promote_types(x.dtype, self.weight.dtype))  # as HF's ``weight * x.to(input_dtype)``
    return y


def _patch_norm(module: nn.Module, fam: _Family) -> bool:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is None or not isinstance(weight, Tensor) or weight.dim() != 1:
        logger.warning("apply_fused_kernels: %s has no 1-D weight and eps; left unpatched", type(module).__name__)
        return False
    module._shardkit_eps = float(eps)
    module._shardkit_offset = fam.norm_offset
    module._shardkit_promotes = fam.norm_promotes
    module.forward = types.MethodType(_rms_norm_forward, module)
    return True


# ---- RoPE --------------------------------------------------------------------------------------------------

def _fused_rope_or_none(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int):
    """The fused rotation when the shapes are the ones the op takes, else None (caller falls back to HF's)."""
    if unsqueeze_dim not in (1, 2) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return None
    if cos.shape[-1] != q.shape[-1] or k.shape[-1] != q.shape[-1]:
        return None  # partial rotary (rotary dim < head dim): not this op's layout
    if unsqueeze_dim == 2:  # (B, T, H, D) layout: the op takes (B, H, T, D); a transposed view is fine
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    seq = q.shape[2]
    if cos.shape[1] != seq or cos.shape[0] not in (1, q.shape[0]) or k.shape[2] != seq:
        return None
    qo, ko = rope(q, k, cos, sin)
    if unsqueeze_dim == 2:
        qo, ko = qo.transpose(1, 2), ko.transpose(1, 2)
    return qo, ko


def _make_rope_wrapper(original: Any) -> Any:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _FUSED_ROPE.get():
            unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
            if len(args) <= 1 and set(kwargs) <= {"unsqueeze_dim"}:
                out = _fused_rope_or_none(q, k, cos, sin, unsqueeze_dim)
                if out is not None:
                    return out
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._shardkit_original = original
    return apply_rotary_pos_emb


def _install_rope_wrapper(modeling: types.ModuleType) -> bool:
    fn = getattr(modeling, "apply_rotary_pos_emb", None)
    if fn is None:
        return False
    if not hasattr(fn, "_shardkit_original"):
        modeling.apply_rotary_pos_emb = _make_rope_wrapper(fn)
    return True


def _attention_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    token = _FUSED_ROPE.set(True)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _FUSED_ROPE.reset(token)


# ---- loss ------------------------------------------------------------------------------------------

def _has_causal_lm_head(model: nn.Module) -> bool:
    return isinstance(getattr(model, "lm_head", None), nn.Linear) and isinstance(getattr(model, "model", None),
                                                                                  nn.Module)


# ---- entry point -------------------------------------------------------------------------------------------

def _family_of(model: nn.Module) -> tuple[str, _Family, types.ModuleType]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    supported = supported_model_types()
    if model_type not in supported:
        hint = ""
        if model_type == "gemma3":
            hint = (" For multimodal Gemma 3 (Gemma3ForConditionalGeneration) patch the text model, "
                    "model.model.language_model (model_type 'gemma3_text'); its loss stays unfused.")
        raise ValueError(f"apply_fused_kernels: model_type {model_type!r} ({type(model).__name__}) is not supported; "
                         f"supported with the installed transformers: {', '.join(supported)}.{hint}")
    fam = _FAMILIES[model_type]
    return model_type, fam, importlib.import_module(fam.module)


def _defined_in(module: nn.Module, modeling: types.ModuleType, suffix: str) -> bool:
    cls = type(module)
    return cls.__module__ == modeling.__name__ and cls.__name__.endswith(suffix)


def apply_fused_kernels(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
                        cross_entropy: bool = True, geglu: bool = True) -> nn.Module:
    """Patch a Hugging Face Llama/Mistral/Mixtral/Phi-3/Qwen2/Gemma(1/2/3) model in place with shardkit's fused ops.

    Accepts the ``*ForCausalLM`` model or the bare ``*Model``/``Gemma3TextModel`` (then there is no loss to
    patch). Calling it twice is harmless. What was patched is logged at INFO and stored as a dict on
    ``model.fused_kernels_report``, e.g. ``{"model_type": "llama", "rms_norm": 5, "rope": 2, "swiglu": 2,
    "geglu": 0, "cross_entropy": True, "skipped": {}}`` (counts of modules patched; reasons for what was left alone).

    Args:
        model: the transformers model (patched in place).
        rms_norm: patch every ``*RMSNorm`` of the family (Gemma: ``offset=1.0``).
        rope: route the family's ``apply_rotary_pos_emb`` to the fused op inside this model's attention.
        swiglu: patch the SiLU gated MLPs with swiglu (Phi-3's fused projection, Mixtral: each expert).
        cross_entropy: compute the causal-LM loss with the fused linear cross-entropy when labels are given
            (``logits`` is then None in the output).
        geglu: patch Gemma's GELU-tanh gated MLPs with geglu.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: ``model.config.model_type`` is not one of the supported families.
    """
    model_type, fam, modeling = _family_of(model)
    report: dict[str, Any] = {"model_type": model_type, "rms_norm": 0, "rope": 0, "swiglu": 0, "geglu": 0,
                              "cross_entropy": False, "skipped": {}}
    if rope and not _install_rope_wrapper(modeling):
        report["skipped"]["rope"] = f"{modeling.__name__} has no apply_rotary_pos_emb"
        rope = False
    non_silu = set()
    for module in model.modules():
        if rms_norm and _defined_in(module, modeling, "RMSNorm"):
            report["rms_norm"] += _patch_norm(module, fam)
        elif rope and _defined_in(module, modeling, "Attention"):
            module.forward = types.MethodType(_attention_forward, module)
            report["rope"] += 1
        elif (swiglu or geglu) and (_defined_in(module, modeling, "MLP") or _defined_in(module, modeling, "Experts")):
            kind = patch_gated_mlp(module, swiglu=swiglu, geglu=geglu)
            if kind is None:
                non_silu.add(activation_name(module))
            elif kind:
                report[kind] += 1
    if non_silu:
        report["skipped"]["swiglu"] = (f"MLP activation {', '.join(sorted(non_silu))} is neither SiLU nor "
                                       "gelu_pytorch_tanh: MLP left unpatched")
    if cross_entropy:
        if _has_causal_lm_head(model):
            model.forward = types.MethodType(causal_lm_forward, model)
            report["cross_entropy"] = True
        else:
            report["skipped"]["cross_entropy"] = f"{type(model).__name__} has no lm_head: no causal-LM loss"
    model.fused_kernels_report = report
    logger.info("apply_fused_kernels(%s): %s", type(model).__name__, report)
    return model
