"""GeGLU (Gemma's MLP): ``gelu_tanh(gate) * up``, the tanh-approximated GELU Gemma's ``gelu_pytorch_tanh`` uses.

Reference here; the kernels are SwiGLU's with the activation switched (``_glu.py``, ``sdk/kernels/swiglu.py``,
``csrc/swiglu/``): ``gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._glu import acc_dtype, build_glu, glu_example
from .registry import OpSpec, register

__all__ = ["SPEC", "geglu", "geglu_reference"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def geglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch GeGLU (differentiable by autograd), computed in fp32 for low-precision inputs."""
    acc = acc_dtype(gate)
    return (F.gelu(gate.to(acc), approximate="tanh") * up.to(acc)).to(gate.dtype)


def _reference_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    acc = acc_dtype(gate)
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    t = torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g * g * g))
    act = 0.5 * g * (1 + t)
    dact = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)
    return (d * u * dact).to(gate.dtype), (d * act).to(up.dtype)


_GLU = build_glu("geglu", True, geglu_reference, _reference_bwd, spec=lambda: SPEC)


def geglu(gate: Tensor, up: Tensor, *, in_place_backward: bool = False) -> Tensor:
    """``gelu(gate, approximate="tanh") * up`` on the best backend for the tensors' device.

    Args:
        gate: output of the gate projection.
        up: output of the up projection, same shape and dtype as ``gate`` for the kernels.
        in_place_backward: write the gradients over ``gate`` and ``up`` in backward (see :func:`swiglu`).

    Returns:
        Tensor like ``gate``.
    """
    return _GLU.function(gate, up, in_place_backward=in_place_backward)


SPEC = register(OpSpec(
    name="geglu", function=geglu, reference=geglu_reference, csrc=None, kernels=_GLU.kernels,
    triton_checks="shardkit.kernels.swiglu:geglu_compile_checks", example=glu_example))
