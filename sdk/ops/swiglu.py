"""SwiGLU: reference (fallback + test oracle), dispatch, autograd and torch.library registration.

``swiglu(gate, up) = silu(gate) * up``. Backward saves only ``gate`` and ``up`` (which the surrounding
linear layers keep alive anyway) and recomputes ``sigmoid(gate)``: nothing of the size of the product is
stored, e.g. 4 x 2048 x 11008 x 2 B = 180 MB per layer in bf16 not kept for a 7B Llama MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .registry import OpSpec, direct_call_ok, native, register

__all__ = ["SPEC", "swiglu", "swiglu_reference"]


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch SwiGLU (differentiable by autograd), computed in fp32 for low-precision inputs."""
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def _reference_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    acc = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, d = gate.to(acc), up.to(acc), dy.to(acc)
    sig = torch.sigmoid(g)
    dg = d * u * sig * (1 + g * (1 - sig))
    return dg.to(gate.dtype), (d * g * sig).to(up.dtype)


def _reference_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return swiglu_reference(gate, up).contiguous()


def _reference_bwd_contiguous(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    dg, du = _reference_bwd(dy, gate, up)
    return dg.contiguous(), du.contiguous()


def _triton_fwd(gate: Tensor, up: Tensor) -> Tensor:
    from shardkit.kernels import swiglu as tk

    return tk.swiglu_fwd(gate.contiguous(), up.contiguous())


def _triton_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    from shardkit.kernels import swiglu as tk

    return tk.swiglu_bwd(dy.contiguous(), gate.contiguous(), up.contiguous())


def _native_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return torch.ops.shardkit_C.swiglu_bwd(dy.to(gate.dtype), gate, up)  # the kernel takes one dtype


def _backend(gate: Tensor, up: Tensor, kernel: str) -> str:
    if gate.dtype != up.dtype or gate.dtype == torch.float64 or gate.shape != up.shape:
        return "reference"
    return SPEC.select(kernel, gate.device)


def _forward(gate: Tensor, up: Tensor) -> Tensor:
    return SPEC.call("swiglu_fwd", _backend(gate, up, "swiglu_fwd"), gate, up)


@torch.library.custom_op("shardkit::swiglu", mutates_args=())
def _swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    return _forward(gate, up)


@_swiglu_op.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(torch.broadcast_shapes(gate.shape, up.shape))


@torch.library.custom_op("shardkit::swiglu_backward", mutates_args=())
def _swiglu_backward_op(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return SPEC.call("swiglu_bwd", _backend(gate, up, "swiglu_bwd"), dy, gate, up)


@_swiglu_backward_op.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return gate.new_empty(dy.shape), up.new_empty(dy.shape)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: Tensor):
    gate, up = ctx.saved_tensors
    dg, du = _swiglu_backward_op(dy, gate, up)
    # reference path with broadcasting: reduce back to each input's shape
    if dg.shape != gate.shape:
        dg = dg.sum_to_size(gate.shape)
    if du.shape != up.shape:
        du = du.sum_to_size(up.shape)
    return dg, du


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` on the best backend for the tensors' device (same shape and dtype for the kernels).

    Args:
        gate: output of the gate projection.
        up: output of the up projection, same shape as ``gate``.

    Returns:
        Tensor like ``gate``.
    """
    return (_forward if direct_call_ok(gate, up) else _swiglu_op)(gate, up)


def _example(device: str, dtype: torch.dtype, size: str) -> tuple:
    m, f = (4096, 11008) if size == "bench" else (5, 123)
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(m, f, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))


SPEC = register(OpSpec(
    name="swiglu", function=swiglu, reference=swiglu_reference, csrc="swiglu",
    kernels={"swiglu_fwd": {"reference": _reference_fwd, "triton": _triton_fwd, **native("swiglu_fwd")},
             "swiglu_bwd": {"reference": _reference_bwd_contiguous, "triton": _triton_bwd,
                            "cpp": _native_bwd, "cuda": _native_bwd}},
    triton_checks="shardkit.kernels.swiglu:compile_checks", example=_example))
