"""SwiGLU: reference (fallback + test oracle), dispatch, autograd and torch.library registration.

``swiglu(gate, up) = silu(gate) * up``. The custom ops, the autograd (inputs saved, activation recomputed,
optionally gradients written over the inputs) and the backend tables are shared with GeGLU (``_glu.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._glu import acc_dtype, build_glu, glu_example
from .registry import OpSpec, register

__all__ = ["SPEC", "swiglu", "swiglu_reference"]


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch SwiGLU (differentiable by autograd), computed in fp32 for low-precision inputs."""
    acc = acc_dtype(gate)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def _reference_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    acc = acc_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    sig = torch.sigmoid(g)
    dg = d * u * sig * (1 + g * (1 - sig))
    return dg.to(gate.dtype), (d * g * sig).to(up.dtype)


_GLU = build_glu("swiglu", False, swiglu_reference, _reference_bwd, spec=lambda: SPEC)


def swiglu(gate: Tensor, up: Tensor, *, in_place_backward: bool = False) -> Tensor:
    """``silu(gate) * up`` on the best backend for the tensors' device (same shape and dtype for the kernels).

    Args:
        gate: output of the gate projection.
        up: output of the up projection, same shape as ``gate``.
        in_place_backward: write the gradients over ``gate`` and ``up`` in backward (Liger-Kernel's memory: no
            new (tokens, intermediate) buffer). Only for activations nothing else reads after this op; taken
            only where both are contiguous non-leaf tensors in eager mode, else the out-of-place backward runs.

    Returns:
        Tensor like ``gate``.
    """
    return _GLU.function(gate, up, in_place_backward=in_place_backward)


SPEC = register(OpSpec(
    name="swiglu", function=swiglu, reference=swiglu_reference, csrc="swiglu", kernels=_GLU.kernels,
    triton_checks="shardkit.kernels.swiglu:compile_checks", example=glu_example))
