"""Per-family rules for the gated MLPs ``apply_fused_kernels`` patches (``sdk/nn/patching.py`` calls them).

- Llama / Mistral / Qwen2 (``gate_proj``, ``up_proj``, ``down_proj`` + SiLU): :func:`shardkit.ops.swiglu`, with
  the backward writing its gradients over the two fresh projections (Liger-Kernel's memory);
- Gemma 1/2/3 (same layout, ``gelu_pytorch_tanh``): :func:`shardkit.ops.geglu`;
- Phi-3 (one ``gate_up_proj``, split in two halves): swiglu on the halves; they are strided views of the fused
  projection, so the backward is the out-of-place one;
- Mixtral (``MixtralExperts``: 3-D ``gate_up_proj`` / ``down_proj`` parameters, a loop over the experts the
  router hit): the same loop with swiglu per expert.

A rule returns the name of the op it patched in, None when the module is not of its form (its activation is
named in the report instead), or "" when its switch is off.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from ..ops import geglu, swiglu

__all__ = ["activation_name", "patch_gated_mlp"]

_SILU_NAMES = ("SiLU", "SiLUActivation")
_GELU_TANH_NAMES = ("GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh")


def activation_name(module: nn.Module) -> str:
    """The class name of the MLP's activation module (``act_fn`` or Phi-3's ``activation_fn``)."""
    return type(getattr(module, "act_fn", getattr(module, "activation_fn", None))).__name__


def _swiglu_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), in_place_backward=True))


def _geglu_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), in_place_backward=True))


def _phi3_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(swiglu(gate, up))


def _experts_forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    # transformers' MixtralExperts loop (eager experts implementation) with the fused activation
    out = torch.zeros_like(hidden)
    with torch.no_grad():
        mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for (expert,) in hit.tolist():
        if expert == self.num_experts:
            continue
        pos, token = torch.where(mask[expert])
        gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
        y = nn.functional.linear(swiglu(gate, up), self.down_proj[expert]) * top_k_weights[token, pos, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _patch_geglu(module: nn.Module) -> str | None:
    if not _has_linears(module, "gate_proj", "up_proj", "down_proj"):
        return None
    module.forward = types.MethodType(_geglu_mlp_forward, module)
    return "geglu"


def _has_linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def patch_gated_mlp(module: nn.Module, swiglu: bool = True, geglu: bool = True) -> str | None:
    """Patch one MLP / experts module of a supported family in place; returns "swiglu", "geglu" or None.

    ``swiglu`` / ``geglu`` switch the SiLU and the GELU-tanh rules (a switched-off rule leaves its modules alone).
    """
    act = activation_name(module)
    if act in _GELU_TANH_NAMES:
        return _patch_geglu(module) if geglu else ""
    if not swiglu:
        return ""
    if act in _SILU_NAMES and _has_linears(module, "gate_proj", "up_proj", "down_proj"):
        module.forward = types.MethodType(_swiglu_mlp_forward, module)
        return "swiglu"
    if act in _SILU_NAMES and _has_linears(module, "gate_up_proj", "down_proj"):
        module.forward = types.MethodType(_phi3_mlp_forward, module)
        return "swiglu"
    experts_params = all(isinstance(getattr(module, n, None), Tensor) and getattr(module, n).dim() == 3
                         for n in ("gate_up_proj", "down_proj"))
    if act in _SILU_NAMES and experts_params and isinstance(getattr(module, "num_experts", None), int):
        module.forward = types.MethodType(_experts_forward, module)
        return "swiglu"
    return None
